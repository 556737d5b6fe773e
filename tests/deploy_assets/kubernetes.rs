//! deploy/kubernetes: every manifest valid against the Kubernetes schemas (kubernetes-validate,
//! strict), every `strata` command a container or probe runs accepted by the binary's parser, the
//! member start script taking each of its three paths, and the probes aimed at the ports the
//! commands open.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{repo, test_data};

const MANIFESTS: [&str; 4] = ["member.yaml", "models.yaml", "node.yaml", "router.yaml"];
/// The oldest Kubernetes release still served by the major clouds, and the newest bundled.
const KUBERNETES_VERSIONS: [&str; 2] = ["1.31.0", "1.37.0"];

fn manifest(name: &str) -> PathBuf {
    repo().join("deploy/kubernetes").join(name)
}

/// `kubernetes-validate --strict` of `files` against `version`: its status and what it printed.
fn kubernetes_validate(files: &[PathBuf], version: &str) -> (bool, String) {
    let dir = test_data("kubernetes-validate");
    let out = Command::new("python3")
        .arg(dir.join("bin/kubernetes-validate"))
        .args(["--strict", "--no-warn", "--kubernetes-version", version])
        .args(files)
        .env("PYTHONPATH", &dir)
        .output()
        .expect("run python3");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), printed)
}

/// The YAML documents of `path` as JSON, read by the PyYAML that kubernetes-validate brings.
fn documents(path: &Path) -> Vec<Value> {
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml\n\
             print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
        ])
        .arg(path)
        .env("PYTHONPATH", test_data("kubernetes-validate"))
        .output()
        .expect("run python3");
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_manifests_are_valid_kubernetes_objects() {
    let files: Vec<PathBuf> = MANIFESTS.iter().map(|m| manifest(m)).collect();
    for version in KUBERNETES_VERSIONS {
        let (ok, printed) = kubernetes_validate(&files, version);
        assert!(ok, "Kubernetes {version}:\n{printed}");
        // Every object was checked, none skipped for want of a schema.
        let objects: usize = files.iter().map(|f| documents(f).len()).sum();
        assert_eq!(
            printed.matches(" passed for ").count(),
            objects,
            "{printed}"
        );
    }

    // Canaries: a number given as a string, and a field Kubernetes does not have.
    let tmp = tempfile::tempdir().unwrap();
    let router = std::fs::read_to_string(manifest("router.yaml")).unwrap();
    let canaries = [
        (
            "containerPort: 8000",
            "containerPort: \"8000\"",
            "is not of type 'integer'",
        ),
        (
            "      terminationGracePeriodSeconds: 130\n",
            "      terminationGracePeriodSeconds: 130\n      terminationGraceSeconds: 130\n",
            "'terminationGraceSeconds' was unexpected",
        ),
    ];
    for (i, (from, to, finding)) in canaries.into_iter().enumerate() {
        assert_eq!(router.matches(from).count(), 1, "{from:?}");
        let bad = tmp.path().join(format!("canary-{i}.yaml"));
        std::fs::write(&bad, router.replace(from, to)).unwrap();
        let (ok, printed) = kubernetes_validate(&[bad], KUBERNETES_VERSIONS[1]);
        assert!(
            !ok && printed.contains(finding),
            "the canary passed: {printed}"
        );
    }
}

/// A pod template's containers (init containers first) with the workload's name.
fn containers(doc: &Value) -> Vec<(String, Value)> {
    let name = doc["metadata"]["name"].as_str().unwrap().to_string();
    let spec = &doc["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| spec[*k].as_array())
        .flatten()
        .map(|c| (name.clone(), c.clone()))
        .collect()
}

fn workloads() -> Vec<Value> {
    MANIFESTS
        .iter()
        .flat_map(|m| documents(&manifest(m)))
        .filter(|d| d["spec"]["template"]["spec"].is_object())
        .collect()
}

/// What the container's environment holds on pod `pod`: the Downward API's fields, sampled.
fn environment(container: &Value, pod: &str) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for var in container["env"].as_array().into_iter().flatten() {
        let name = var["name"].as_str().unwrap().to_string();
        let value = match (
            &var["value"],
            var["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        ) {
            (Value::String(v), _) => v.clone(),
            (_, Some("metadata.name")) => pod.to_string(),
            (_, Some("status.podIP")) => "10.0.0.7".to_string(),
            other => panic!("no sample for {name}: {other:?}"),
        };
        env.insert(name, value);
    }
    env
}

/// `words` with Kubernetes' `$(VAR)` references replaced from `env`.
fn expand(words: &[Value], env: &BTreeMap<String, String>) -> Vec<String> {
    words
        .iter()
        .map(|w| {
            let mut word = w.as_str().unwrap().to_string();
            for (name, value) in env {
                word = word.replace(&format!("$({name})"), value);
            }
            assert!(!word.contains("$("), "unexpanded {word}");
            word
        })
        .collect()
}

/// A folder holding a `strata` that records its arguments and whether the real binary's parser
/// accepts them (it runs them with `--help`, which parses everything before printing).
struct RecordingStrata {
    dir: tempfile::TempDir,
}

impl RecordingStrata {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let script = format!(
            "#!/bin/sh\n\"{}\" \"$@\" --help >/dev/null 2>>\"{log}.err\"\nstatus=$?\n\
             printf '%s %s\\n' \"$status\" \"$*\" >>\"{log}\"\nexit $status\n",
            env!("CARGO_BIN_EXE_strata"),
            log = dir.path().join("calls").display(),
        );
        let path = dir.path().join("strata");
        std::fs::write(&path, script).unwrap();
        let mut permissions = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o755);
        std::fs::set_permissions(&path, permissions).unwrap();
        Self { dir }
    }

    /// Runs `sh` with `args` and `env`, this `strata` first on PATH, within 20 s; the calls it
    /// made since the last run, each `(accepted, arguments)`.
    fn run_sh(&self, args: &[String], env: &BTreeMap<String, String>) -> Vec<(bool, String)> {
        let log = self.dir.path().join("calls");
        let _ = std::fs::remove_file(&log);
        let path = format!(
            "{}:{}",
            self.dir.path().display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut child = Command::new("sh")
            .args(args)
            .envs(env)
            .env("PATH", path)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while child.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("sh {args:?} still runs after 20 s (a loop waiting on a failing command?)");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let errors = std::fs::read_to_string(self.dir.path().join("calls.err")).unwrap_or_default();
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| {
                let (status, args) = l.split_once(' ').unwrap();
                (status == "0", format!("{args} ({errors})"))
            })
            .collect()
    }
}

/// Every call accepted; the subcommands called, in order (`cluster init`, ...).
fn accepted(calls: &[(bool, String)]) -> Vec<String> {
    calls
        .iter()
        .map(|(ok, args)| {
            assert!(ok, "strata refused: {args}");
            args.split_whitespace()
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect()
}

#[test]
fn every_strata_command_of_the_manifests_parses() {
    let strata = RecordingStrata::new();
    let mut checked = 0;
    for doc in workloads() {
        for (workload, container) in containers(&doc) {
            let env = environment(&container, &format!("{workload}-1"));
            let mut commands = vec![container["command"].clone()];
            for probe in ["startupProbe", "livenessProbe", "readinessProbe"] {
                commands.push(container[probe]["exec"]["command"].clone());
            }
            for command in commands.iter().filter_map(Value::as_array) {
                let words = expand(command, &env);
                if words[0] == "strata" {
                    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
                        .args(&words[1..])
                        .arg("--help")
                        .output()
                        .unwrap();
                    assert!(out.status.success(), "{words:?}: {out:?}");
                    checked += 1;
                } else if words[0] == "sh" && words[1] == "-c" && words[2].contains("strata ") {
                    let calls = strata.run_sh(&words[1..], &env);
                    assert!(!accepted(&calls).is_empty(), "{words:?} ran no strata");
                    checked += 1;
                }
            }
        }
    }
    // The node and the router, and the probes of members and nodes.
    assert!(checked >= 5, "only {checked} commands found");
}

/// The member start script (ConfigMap strata-member-start) run as each container that uses it
/// would run it: a new strata-member-0 creates the cluster, any other new pod gets a token and
/// joins, and a pod with a data directory serves from it.
#[test]
fn the_member_start_script_inits_joins_or_serves() {
    let config = documents(&manifest("member.yaml"))
        .into_iter()
        .find(|d| d["kind"] == "ConfigMap")
        .unwrap();
    let script = config["data"]["member.sh"].as_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (data, operator) = (tmp.path().join("member"), tmp.path().join("operator"));
    std::fs::create_dir_all(&operator).unwrap();
    std::fs::write(operator.join("operator.pem"), "").unwrap();
    let mut local = script.to_string();
    for (from, to) in [
        ("data=/var/lib/strata/member\n", &data),
        ("operator=/etc/strata/operator\n", &operator),
        ("token=/tmp/join-token\n", &tmp.path().join("join-token")),
    ] {
        assert_eq!(local.matches(from).count(), 1, "{from:?}");
        let assignment = from.split('=').next().unwrap();
        local = local.replace(from, &format!("{assignment}={}\n", to.display()));
    }
    let path = tmp.path().join("member.sh");
    std::fs::write(&path, local).unwrap();

    let strata = RecordingStrata::new();
    let mut users = 0;
    for doc in workloads() {
        for (workload, container) in containers(&doc) {
            let env = environment(&container, &format!("{workload}-1"));
            let command = expand(container["command"].as_array().unwrap(), &env);
            if command.get(1).map(String::as_str) != Some("/etc/strata/start/member.sh") {
                continue;
            }
            users += 1;
            let mut args = command[1..].to_vec();
            args[0] = path.display().to_string();
            let run = |pod: &str| {
                let mut env = environment(&container, pod);
                env.insert("POD_NAME".into(), pod.into());
                accepted(&strata.run_sh(&args, &env))
            };
            let _ = std::fs::remove_dir_all(&data);
            let first = format!("{workload}-0");
            let expected = if first == "strata-member-0" {
                vec!["cluster init"]
            } else {
                vec!["cluster token", "cluster join"]
            };
            assert_eq!(run(&first), expected, "{first}");
            assert_eq!(
                run(&format!("{workload}-2")),
                ["cluster token", "cluster join"]
            );
            std::fs::create_dir_all(&data).unwrap();
            std::fs::write(data.join("member.toml"), "").unwrap();
            assert_eq!(run(&first), ["cluster serve"], "{first} restarted");
        }
    }
    assert_eq!(users, 2, "the members and the nodes' members");
}

/// The `:PORT ` pattern (hex, as /proc/net/udp writes it) a probe greps for.
fn probed_port(container: &Value, probe: &str) -> Option<String> {
    let words = container[probe]["exec"]["command"].as_array()?;
    let pattern = words
        .iter()
        .filter_map(Value::as_str)
        .find(|w| w.starts_with(':'))?;
    Some(pattern.to_string())
}

#[test]
fn the_probes_check_the_ports_and_routes_the_commands_open() {
    let hex = |port: u16| format!(":{port:04X} ");
    // The members listen where member.sh says.
    let member_listen: u16 = {
        let text = std::fs::read_to_string(manifest("member.yaml")).unwrap();
        let ports: Vec<&str> = text
            .match_indices("--listen 0.0.0.0:")
            .map(|(at, m)| text[at + m.len()..].split_whitespace().next().unwrap())
            .collect();
        assert!(ports.windows(2).all(|w| w[0] == w[1]), "{ports:?}");
        ports[0].parse().unwrap()
    };
    let mut seen = 0;
    for doc in workloads() {
        for (workload, container) in containers(&doc) {
            let env = environment(&container, &format!("{workload}-1"));
            let command = expand(container["command"].as_array().unwrap(), &env);
            let flag = |name: &str| {
                let at = command.iter().position(|w| w == name)?;
                command.get(at + 1).cloned()
            };
            let what = format!("{workload}/{}", container["name"]);
            if command.get(1).map(String::as_str) == Some("/etc/strata/start/member.sh") {
                for probe in ["startupProbe", "livenessProbe"] {
                    assert_eq!(
                        probed_port(&container, probe),
                        Some(hex(member_listen)),
                        "{what}"
                    );
                }
                seen += 1;
            } else if command[..3] == ["strata", "node", "serve"] {
                let listen: std::net::SocketAddr = flag("--listen").unwrap().parse().unwrap();
                assert_eq!(
                    probed_port(&container, "livenessProbe"),
                    Some(hex(listen.port())),
                    "{what}"
                );
                seen += 1;
            } else if command[..2] == ["strata", "router"] {
                let port: u16 = flag("--port").unwrap().parse().unwrap();
                let ports = container["ports"].as_array().unwrap();
                let http = ports.iter().find(|p| p["name"] == "http").unwrap();
                assert_eq!(http["containerPort"].as_u64(), Some(u64::from(port)));
                for (probe, path) in [
                    ("startupProbe", "/health"),
                    ("livenessProbe", "/health"),
                    ("readinessProbe", "/ready"),
                ] {
                    let get = &container[probe]["httpGet"];
                    assert_eq!(
                        (get["path"].as_str(), get["port"].as_str()),
                        (Some(path), Some("http"))
                    );
                }
                seen += 1;
            }
            // Requests and limits for every container; the node's include its GPU.
            let resources = &container["resources"];
            for kind in ["requests", "limits"] {
                for resource in ["cpu", "memory"] {
                    assert!(
                        resources[kind][resource].is_string(),
                        "{what}: {kind}.{resource}"
                    );
                }
            }
            if command.get(1).map(String::as_str) == Some("node") {
                assert_eq!(resources["limits"]["nvidia.com/gpu"], 1, "{what}");
                assert_eq!(resources["requests"]["nvidia.com/gpu"], 1, "{what}");
            }
        }
    }
    assert_eq!(seen, 4, "members, the nodes' members, nodes, routers");
}
