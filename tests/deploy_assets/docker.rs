//! deploy/docker/Dockerfile: no finding from hadolint (a canary with a root USER must get one),
//! and the stages the manifests' images name, each with the binary at /usr/local/bin/strata and a
//! numeric non-root user. No Docker engine runs here: the images themselves are not built.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use super::{repo, test_data};

/// hadolint's findings on `dockerfile` (its JSON report) and its status; every level fails.
fn hadolint(dockerfile: &Path) -> (bool, Vec<serde_json::Value>) {
    let tmp = tempfile::tempdir().unwrap();
    // Its own configuration, so that no file of this machine's changes what is checked.
    let config = tmp.path().join("hadolint.yaml");
    std::fs::write(&config, "failure-threshold: style\n").unwrap();
    let out = Command::new(test_data("hadolint").join("bin/hadolint"))
        .args(["--no-color", "--format", "json", "--config"])
        .arg(&config)
        .arg(dockerfile)
        .output()
        .expect("run hadolint");
    let findings = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("hadolint printed no JSON ({e}): {out:?}"));
    (out.status.success(), findings)
}

/// Per stage name: its base image, what it copies to (`COPY` destinations) and its last `USER`.
#[derive(Default, Debug)]
struct Stage {
    base: String,
    copied_to: Vec<String>,
    user: Option<String>,
}

fn stages(text: &str) -> BTreeMap<String, Stage> {
    let mut stages = BTreeMap::new();
    let mut current = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["FROM", base, "AS", name] => {
                let stage = Stage {
                    base: base.to_string(),
                    ..Stage::default()
                };
                stages.insert(name.to_string(), stage);
                current = Some(name.to_string());
            }
            ["COPY", .., to] => {
                let name = current.as_ref().expect("COPY before FROM");
                stages.get_mut(name).unwrap().copied_to.push(to.to_string());
            }
            ["USER", user] => {
                let name = current.as_ref().expect("USER before FROM");
                stages.get_mut(name).unwrap().user = Some(user.to_string());
            }
            _ => {}
        }
    }
    stages
}

#[test]
fn the_dockerfile_lints_clean_and_has_the_stages_the_manifests_run() {
    let path = repo().join("deploy/docker/Dockerfile");
    let (ok, findings) = hadolint(&path);
    assert!(ok && findings.is_empty(), "{findings:#?}");

    let text = std::fs::read_to_string(&path).unwrap();
    let stages = stages(&text);
    let rust = env!("CARGO_PKG_RUST_VERSION");
    assert!(
        stages["builder"].base.starts_with(&format!("rust:{rust}")),
        "the builder is not on Rust {rust}: {:?}",
        stages["builder"]
    );
    assert!(
        stages["cuda"].base.starts_with("nvidia/cuda:")
            && stages["cuda"].base.contains("-runtime-")
    );
    assert!(stages["slim"].base.starts_with("debian:") && stages["slim"].base.ends_with("-slim"));
    for name in ["cuda", "slim"] {
        let stage = &stages[name];
        assert!(
            stage
                .copied_to
                .iter()
                .any(|to| to == "/usr/local/bin/strata"),
            "{stage:?}"
        );
        let uid = stage
            .user
            .as_deref()
            .and_then(|u| u.split(':').next()?.parse::<u32>().ok());
        assert!(
            uid.is_some_and(|uid| uid != 0),
            "{name} runs as {:?}",
            stage.user
        );
    }

    // The images the manifests run are these stages, tagged with the crate's version.
    let manifests = std::fs::read_dir(repo().join("deploy/kubernetes")).unwrap();
    let mut images = 0;
    for entry in manifests {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for image in text
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image: "))
        {
            let tag = image
                .strip_prefix("strata:")
                .unwrap_or_else(|| panic!("{image}"));
            let stage = tag
                .strip_prefix(concat!(env!("CARGO_PKG_VERSION"), "-"))
                .unwrap_or_else(|| panic!("{image} is not version {}", env!("CARGO_PKG_VERSION")));
            assert!(stages.contains_key(stage) && stage != "builder", "{image}");
            images += 1;
        }
    }
    assert!(images > 0);

    // Canary: a final stage left running as root is reported.
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("Dockerfile");
    let user = format!("USER {}\n", stages["slim"].user.as_deref().unwrap());
    assert!(text.ends_with(&format!(
        "{user}WORKDIR /var/lib/strata\nCMD [\"strata\", \"--help\"]\n"
    )));
    let at = text.rfind(&user).unwrap();
    std::fs::write(
        &bad,
        format!("{}USER root\n{}", &text[..at], &text[at + user.len()..]),
    )
    .unwrap();
    let (ok, findings) = hadolint(&bad);
    let codes: Vec<&str> = findings.iter().filter_map(|f| f["code"].as_str()).collect();
    assert!(
        !ok && codes.contains(&"DL3002"),
        "the canary passed: {findings:#?}"
    );
}
