//! `strata keys`: add prints a key once and stores only its hash; list never shows keys; revoke
//! removes one.

use std::path::Path;
use std::process::{Command, Output};

fn keys(args: &[&str], file: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .arg("keys")
        .args(args)
        .arg("--keys-file")
        .arg(file)
        .output()
        .expect("run strata")
}

fn stdout(o: &Output) -> String {
    assert!(
        o.status.success(),
        "strata failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn add_list_revoke() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("keys.json");

    let key = stdout(&keys(&["add", "--tenant", "acme"], &file))
        .trim()
        .to_string();
    assert!(key.starts_with("sk-strata-") && key.len() > 40, "{key}");
    let secret = &key["sk-strata-".len()..];
    let stored = std::fs::read_to_string(&file).unwrap();
    assert!(
        !stored.contains(secret),
        "the keys file holds the key: {stored}"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&file).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "keys file mode {mode:o}");
    }

    let list = stdout(&keys(&["list"], &file));
    let id = &secret[..8];
    let row: Vec<&str> = list.trim().split('\t').collect();
    assert_eq!(&row[..2], &[id, "acme"], "{list}");
    assert!(!list.contains(secret), "list shows the key: {list}");

    let unknown = keys(&["revoke", "nope"], &file);
    assert!(!unknown.status.success());
    assert!(String::from_utf8_lossy(&unknown.stderr).contains("nope"));

    stdout(&keys(&["revoke", id], &file));
    assert_eq!(stdout(&keys(&["list"], &file)).trim(), "");
}

#[test]
fn an_empty_tenant_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("keys.json");
    let o = keys(&["add", "--tenant", ""], &file);
    assert!(!o.status.success());
    assert!(!file.exists());
}
