//! Hosts on one machine for tests of what crosses a network (DESIGN.md §6): each host is a
//! network namespace whose one link (a veth pair) ends on a bridge in the test's own namespace,
//! so the test process reaches every host at its address and can cut and heal any host's link
//! (both directions: the link goes down) or drop one direction only (a blackhole route inside
//! the host, for traffic it sends to one peer). Processes started in a host run there through
//! `ip netns exec`, which execs them: their pid is the program's own.
//!
//! Needs root and iproute2's `ip` (CI runs as root); a test that cannot make its hosts fails
//! rather than skips. Everything made is removed when the [`Net`] drops, its processes first.

#![allow(dead_code)]

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicU8, Ordering};

static NETS: AtomicU8 = AtomicU8::new(0);

/// One bridge and the hosts on it, in 10.`a`.`b`.0/24 (the bridge is .254).
pub struct Net {
    tag: String,
    bridge: String,
    subnet: [u8; 3],
    hosts: Vec<Host>,
}

/// A namespace with one address on the net.
#[derive(Debug, Clone)]
pub struct Host {
    pub ns: String,
    pub ip: Ipv4Addr,
    /// The link's end on the bridge, in the test's namespace.
    link: String,
}

/// Runs `ip` with `args`; panics naming the command when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run ip {args:?} ({e}): iproute2 is needed"));
    assert!(
        out.status.success(),
        "ip {} failed: {} (these tests need root)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

impl Net {
    pub fn new() -> Net {
        let n = NETS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        // Interface names have at most 15 bytes: "sb" + 8 hex digits + "x" + host number.
        let tag = format!("{:06x}{n:02x}", pid & 0xff_ffff);
        let bridge = format!("sb{tag}");
        let subnet = [
            10,
            100 + (pid % 100) as u8,
            n.wrapping_mul(7).wrapping_add(1),
        ];
        ip(&["link", "add", &bridge, "type", "bridge"]);
        let net = Net {
            tag,
            bridge,
            subnet,
            hosts: Vec::new(),
        };
        let gateway = format!("{}/24", net.gateway());
        ip(&["addr", "add", &gateway, "dev", &net.bridge]);
        ip(&["link", "set", &net.bridge, "up"]);
        net
    }

    /// The test's own address on the net (the bridge's).
    pub fn gateway(&self) -> Ipv4Addr {
        Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], 254)
    }

    /// Host number `n` (1..=200), its link up.
    pub fn host(&mut self, n: u8) -> Host {
        assert!((1..=200).contains(&n));
        let ns = format!("strata-{}-{n}", self.tag);
        let link = format!("sv{}{n}", self.tag);
        let addr = Ipv4Addr::new(self.subnet[0], self.subnet[1], self.subnet[2], n);
        ip(&["netns", "add", &ns]);
        let host = Host {
            ns: ns.clone(),
            ip: addr,
            link: link.clone(),
        };
        self.hosts.push(host.clone());
        ip(&[
            "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &link, "master", &self.bridge]);
        ip(&["link", "set", &link, "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{addr}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        host
    }

    /// Cuts `host` off: its link goes down, nothing passes either way.
    pub fn cut(&self, host: &Host) {
        ip(&["link", "set", &host.link, "down"]);
    }

    /// Restores `host`'s link.
    pub fn heal(&self, host: &Host) {
        ip(&["link", "set", &host.link, "up"]);
    }

    /// Drops what `host` sends to `to`; what `to` sends still arrives (asymmetric loss).
    pub fn drop_from(&self, host: &Host, to: Ipv4Addr) {
        ip(&[
            "-n",
            &host.ns,
            "route",
            "add",
            "blackhole",
            &format!("{to}/32"),
        ]);
    }

    /// Undoes [`Net::drop_from`].
    pub fn undrop_from(&self, host: &Host, to: Ipv4Addr) {
        ip(&[
            "-n",
            &host.ns,
            "route",
            "del",
            "blackhole",
            &format!("{to}/32"),
        ]);
    }
}

impl Host {
    /// A command running `program` inside this host.
    pub fn command(&self, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.ns, program]);
        command
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        for host in &self.hosts {
            // Whatever still runs inside goes first: a namespace with processes lingers.
            if let Ok(out) = Command::new("ip")
                .args(["netns", "pids", &host.ns])
                .output()
            {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", &host.ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}
