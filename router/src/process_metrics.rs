//! The standard Prometheus process metrics (`process_*`, the names every client library's process
//! collector exports, so existing dashboards and alerts apply): CPU time, memory, file
//! descriptors and start time, read from `/proc/self` on Linux. Elsewhere nothing is written.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;

use crate::metrics::{Labels, counters, gauges};

/// Linux reports CPU times and start times in clock ticks of `USER_HZ`, 100 on every
/// architecture the kernel ships (it is a fixed ABI value, unlike `CONFIG_HZ`).
const USER_HZ: f64 = 100.0;

/// The process families, read from `/proc/self` when a scrape encodes them (nothing when it
/// cannot be read).
#[derive(Debug)]
pub struct Process;

impl Collector for Process {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(m) = read() else { return Ok(()) };
        let one = |v: f64| [(Labels::new(), v)];
        let e = &mut encoder;
        counters(
            e,
            "process_cpu_seconds_total",
            "Total user and system CPU time spent in seconds.",
            one(m.cpu_seconds),
        )?;
        let families = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                m.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes.",
                m.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors.",
                m.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors.",
                m.max_fds,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                m.start_time,
            ),
        ];
        for (name, help, value) in families {
            gauges(e, name, help, one(value))?;
        }
        Ok(())
    }
}

struct Figures {
    cpu_seconds: f64,
    resident_bytes: f64,
    virtual_bytes: f64,
    open_fds: f64,
    max_fds: f64,
    start_time: f64,
}

fn read() -> Option<Figures> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) may hold spaces and parentheses: fields count from the last ')'.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // After the name: state is field 3, so field n is fields[n - 3].
    let field = |n: usize| fields.get(n - 3)?.parse::<f64>().ok();
    let ticks = field(14)? + field(15)?;
    let start_ticks = field(22)?;
    let virtual_bytes = field(23)?;
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let resident_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())?;
    let boot_time = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    Some(Figures {
        cpu_seconds: ticks / USER_HZ,
        resident_bytes: resident_kib * 1024.0,
        virtual_bytes,
        open_fds,
        max_fds,
        start_time: boot_time + start_ticks / USER_HZ,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_process_reports_its_own_figures() {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(super::Process));
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry).unwrap();
        if !std::path::Path::new("/proc/self/stat").exists() {
            assert!(out.is_empty());
            return;
        }
        let value = |name: &str| -> f64 {
            out.lines()
                .find(|l| l.starts_with(&format!("{name} ")))
                .and_then(|l| l.rsplit(' ').next())
                .and_then(|v| v.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in\n{out}"))
        };
        assert!(value("process_resident_memory_bytes") > 1e6);
        assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
        assert!(value("process_open_fds") >= 3.0);
        assert!(value("process_max_fds") >= value("process_open_fds"));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        let started = value("process_start_time_seconds");
        // This test process started within the last hour, not in the future.
        assert!(
            started <= now + 1.0 && started > now - 3600.0,
            "{started} vs {now}"
        );
        assert!(value("process_cpu_seconds_total") >= 0.0);
    }
}
