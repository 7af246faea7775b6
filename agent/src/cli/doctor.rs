//! `gpuhub doctor`: checks the node end to end and says what to fix.
//!
//! Three sources: the plugstack and `sinfo` (read here), the agent's own checks
//! (`/v1/status`: store ping, spool probe, snapshot, NVML, job key, MLflow), and, when run as
//! root with the agent's configuration (`GPUHUB_CONFIG`, else `/etc/gpuhub/agent.toml` or the
//! embedded defaults, used only when its control socket is the one asked), the files on disk
//! as the plugin sees them. The agent cannot see those faults from memory: it holds the job key
//! and the store connection it opened at start, so a key file deleted, made readable by users
//! or emptied since, or an SQLite file removed or overwritten, still pass its checks.
//! The local checks:
//! - `spool`: the directory exists (checked before asking the agent, whose probe would create
//!   it), is a directory with a directory `records/`, is writable (read-only file system,
//!   immutable flag) and is not writable by users (who could forge usage records);
//! - `snapshot`: exists, parses (version included) and says what the agent says now
//!   (`/v1/env`: gateway URL, MLflow URI, every `<ROLE>_MODEL`); otherwise it is stale;
//! - `job-key`: a regular file, owned by root, mode 0600 or stricter, at least 16 bytes and
//!   no trailing whitespace (the plugin signs with the raw bytes, the agent verifies with them
//!   trimmed), the rules the plugin itself applies;
//! - `store` (SQLite only): the database file exists and starts with the SQLite header.
//!
//! A failing local check replaces the agent's check of the same name.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use gpuhub_wire::snapshot::{MAX_SNAPSHOT_BYTES, Snapshot, role_env_var};

use super::output;
use crate::config::Config;
use crate::control::client;
use crate::control::status::Check;

/// Where Slurm looks for plugstack configuration on RHEL and Debian.
const PLUGSTACK_DIRS: &[&str] = &["/etc/slurm/plugstack.conf.d", "/etc/slurm-llnl/plugstack.conf.d"];
const PLUGSTACK_FILES: &[&str] = &["/etc/slurm/plugstack.conf", "/etc/slurm-llnl/plugstack.conf"];

pub async fn run(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let mut checks = vec![plugin_check(), slurm_check().await];
    let (config_check, config) = agent_config(socket);
    checks.extend(config_check);
    // Before the agent's checks: its spool probe creates a missing spool directory.
    let mut local: Vec<Check> = config.iter().map(|c| spool_check(&c.file.paths.spool_dir)).collect();
    match client::request(socket, "GET", "/v1/status", None).await {
        Ok(v) => {
            checks.push(Check { name: "agent".into(), ok: true, detail: format!("reachable at {}", socket.display()), fix: None });
            let agent: Vec<Check> = serde_json::from_value(v).unwrap_or_default();
            if let Some(c) = &config {
                let env = client::request(socket, "GET", "/v1/env", None).await.ok();
                local.push(snapshot_check(&c.snapshot_path, env.as_ref()));
                local.push(job_key_check(&c.job_key_path));
                local.extend(store_file_check(&c.store_url));
            }
            checks.extend(merge(agent, local));
        }
        Err(e) => {
            checks.push(Check {
                name: "agent".into(),
                ok: false,
                detail: e.to_string(),
                fix: Some("start it: systemctl start gpuhub-agent (logs: journalctl -u gpuhub-agent)".into()),
            });
            // Without the agent's view, the files still tell (the snapshot's content is not compared).
            if let Some(c) = &config {
                local.push(snapshot_check(&c.snapshot_path, None));
                local.push(job_key_check(&c.job_key_path));
                local.extend(store_file_check(&c.store_url));
            }
            checks.extend(local);
        }
    }
    let all_ok = checks.iter().all(|c| c.ok);
    if json {
        output::json(&serde_json::to_value(&checks).unwrap_or_default());
    } else {
        for c in &checks {
            output::line(&format!("{:<4} {:<14} {}", if c.ok { "ok" } else { "FAIL" }, c.name, crate::util::sanitize(&c.detail)));
            if let Some(fix) = &c.fix {
                output::line(&format!("                    fix: {fix}"));
            }
        }
    }
    Ok(if all_ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Is `spank_gpuhub.so` in the plugstack, and does the file it names exist?
fn plugin_check() -> Check {
    let mut files: Vec<std::path::PathBuf> = PLUGSTACK_FILES.iter().map(Into::into).collect();
    for d in PLUGSTACK_DIRS {
        if let Ok(rd) = std::fs::read_dir(d) {
            files.extend(rd.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "conf")));
        }
    }
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        for line in text.lines().map(str::trim).filter(|l| !l.starts_with('#')) {
            let mut words = line.split_whitespace();
            let (Some(_mode), Some(so)) = (words.next(), words.next()) else { continue };
            if !(so.contains("spank_gpuhub") || so.contains("libgpuhub_spank")) {
                continue;
            }
            let exists = if so.starts_with('/') { Path::new(so).exists() } else { true };
            return Check {
                name: "plugin".into(),
                ok: exists,
                detail: format!("{} in {}", so, f.display()),
                fix: (!exists)
                    .then(|| format!("{so} does not exist: reinstall gpuhub-spank (a Slurm major upgrade needs a rebuilt plugin)")),
            };
        }
    }
    Check {
        name: "plugin".into(),
        ok: false,
        detail: "spank_gpuhub.so is not in any plugstack file".into(),
        fix: Some("install gpuhub-spank (it ships /etc/slurm/plugstack.conf.d/gpuhub.conf) and restart slurmd".into()),
    }
}

async fn slurm_check() -> Check {
    let run =
        tokio::time::timeout(Duration::from_secs(5), tokio::process::Command::new("sinfo").args(["-h", "-o", "%n %T"]).output()).await;
    match run {
        Ok(Ok(out)) if out.status.success() => {
            let text = String::from_utf8_lossy(&out.stdout);
            let first = text.lines().next().unwrap_or("no nodes").to_string();
            Check { name: "slurm".into(), ok: true, detail: format!("sinfo: {first}"), fix: None }
        }
        Ok(Ok(out)) => Check {
            name: "slurm".into(),
            ok: false,
            detail: format!("sinfo failed: {}", String::from_utf8_lossy(&out.stderr).trim()),
            fix: Some("check slurmctld and munge (systemctl status slurmctld munge)".into()),
        },
        Ok(Err(e)) => Check {
            name: "slurm".into(),
            ok: false,
            detail: format!("cannot run sinfo: {e}"),
            fix: Some("install the Slurm client tools".into()),
        },
        Err(_) => {
            Check { name: "slurm".into(), ok: false, detail: "sinfo did not answer within 5 s".into(), fix: Some("check slurmctld".into()) }
        }
    }
}

/// The agent's configuration for the local file checks, and a `config` check when it cannot be
/// used. `None` (with a note or a failure): the local checks are left out.
fn agent_config(socket: &Path) -> (Option<Check>, Option<Config>) {
    let explicit = std::env::var_os("GPUHUB_CONFIG").filter(|v| !v.is_empty()).map(PathBuf::from);
    let path = explicit.clone().unwrap_or_else(|| PathBuf::from("/etc/gpuhub/agent.toml"));
    let note = |detail: String| Some(Check { name: "config".into(), ok: true, detail, fix: None });
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return (note("not root: the spool, snapshot, job key and store files are checked by the agent only".into()), None);
    }
    match Config::load(&path, explicit.is_none()) {
        Ok(c) if c.control_socket == socket => (None, Some(c)),
        Ok(c) if explicit.is_some() => (
            Some(Check {
                name: "config".into(),
                ok: false,
                detail: format!(
                    "GPUHUB_CONFIG={} is the configuration of the agent at {}, not of {}",
                    path.display(),
                    c.control_socket.display(),
                    socket.display()
                ),
                fix: Some("point GPUHUB_CONFIG at the agent's own agent.toml (or pass its --socket)".into()),
            }),
            None,
        ),
        Ok(c) => (
            note(format!(
                "{} describes the agent at {}, not {}: its files are checked by the agent only (set GPUHUB_CONFIG to its agent.toml)",
                c.source.as_deref().unwrap_or(&path).display(),
                c.control_socket.display(),
                socket.display()
            )),
            None,
        ),
        Err(e) => (
            Some(Check {
                name: "config".into(),
                ok: false,
                detail: e.to_string(),
                fix: Some("fix the file (gpuhub-agent check-config shows what is wrong) or set GPUHUB_CONFIG".into()),
            }),
            None,
        ),
    }
}

/// The agent's checks with each failing local check in place of the agent's one of that name
/// (it says more: which file and how it is wrong), or appended when the agent has none.
fn merge(agent: Vec<Check>, local: Vec<Check>) -> Vec<Check> {
    let mut out = agent;
    for l in local.into_iter().filter(|l| !l.ok) {
        match out.iter_mut().find(|c| c.name == l.name) {
            Some(c) => *c = l,
            None => out.push(l),
        }
    }
    out
}

fn fail(name: &str, detail: String, fix: String) -> Check {
    Check { name: name.into(), ok: false, detail, fix: Some(fix) }
}

fn pass(name: &str, detail: String) -> Check {
    Check { name: name.into(), ok: true, detail, fix: None }
}

/// `access(2)` for writing: sees a read-only file system and the immutable flag, which a
/// mode check does not (root writes regardless of mode), without writing anything.
fn writable(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    if unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0 { Ok(()) } else { Err(std::io::Error::last_os_error()) }
}

/// The spool as the plugin (root) writes it and the agent reads it.
pub fn spool_check(dir: &Path) -> Check {
    let d = dir.display();
    let meta = match std::fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return fail(
                "spool",
                format!("{d} missing: usage records of new jobs have nowhere to go"),
                format!("mkdir -m 0755 {d} (owned by root), or fix paths.spool_dir in agent.toml; it must match the plugstack spool_dir"),
            );
        }
        Err(e) => return fail("spool", format!("{d}: {e}"), format!("make {d} a directory root can read and write")),
    };
    if !meta.is_dir() {
        return fail("spool", format!("{d} is not a directory"), format!("move it away and mkdir -m 0755 {d} (owned by root)"));
    }
    let records = dir.join(gpuhub_wire::spool::RECORDS_DIR);
    if let Ok(m) = std::fs::symlink_metadata(&records)
        && !m.is_dir()
    {
        return fail(
            "spool",
            format!("{} is not a directory: the plugin cannot write records, the agent cannot read them", records.display()),
            format!("move it away; the plugin recreates {} (0700) with the next record", records.display()),
        );
    }
    if let Err(e) = writable(dir) {
        return fail(
            "spool",
            format!("{d} is not writable: {e}"),
            format!("the plugin (root) must write there: remount read-write, `chattr -i {d}`, or free space"),
        );
    }
    if meta.uid() != 0 || meta.mode() & 0o022 != 0 {
        return fail(
            "spool",
            format!(
                "{d} is writable by others (owner uid {}, mode {:o}): users could forge usage records",
                meta.uid(),
                meta.mode() & 0o7777
            ),
            format!("chown root {d} && chmod 755 {d}"),
        );
    }
    pass("spool", format!("{d} writable (root only)"))
}

/// The snapshot file, and whether it still says what the agent says (`env`: `/v1/env`).
pub fn snapshot_check(path: &Path, env: Option<&serde_json::Value>) -> Check {
    let p = path.display();
    let restart = "restart gpuhub-agent, which rewrites it at start (if it stays wrong, look for `cannot write the snapshot` in its log; paths.runtime_dir must be writable)";
    let bytes = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return fail("snapshot", format!("{p} missing: jobs get no <ROLE>_MODEL and fall back to plugstack arguments"), restart.into());
        }
        Err(e) => return fail("snapshot", format!("{p}: {e}"), restart.into()),
        Ok(m) if !m.is_file() => return fail("snapshot", format!("{p} is not a regular file"), restart.into()),
        Ok(m) if m.len() > MAX_SNAPSHOT_BYTES => {
            return fail(
                "snapshot",
                format!("{p} is {} bytes, over the plugin's {MAX_SNAPSHOT_BYTES}-byte limit", m.len()),
                restart.into(),
            );
        }
        Ok(_) => match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => return fail("snapshot", format!("{p}: {e}"), restart.into()),
        },
    };
    let snap = match Snapshot::parse(&bytes) {
        Ok(s) => s,
        Err(e) => return fail("snapshot", format!("{p}: {e}; the plugin ignores it"), restart.into()),
    };
    if let Some(env) = env.and_then(serde_json::Value::as_object)
        && let Some(diff) = snapshot_differs(&snap, env)
    {
        return fail("snapshot", format!("{p} is stale: {diff}; new jobs get the old values"), restart.into());
    }
    let age = crate::util::now_s().saturating_sub(snap.generated_at);
    pass("snapshot", format!("{p} current (written {age}s ago)"))
}

/// What the snapshot says differently from the agent's variables, or `None`.
pub fn snapshot_differs(snap: &Snapshot, env: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
    let mut from_snap: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
    if let Some(u) = &snap.gateway_url {
        from_snap.insert("GPUHUB_URL".into(), u.clone());
    }
    if let Some(u) = &snap.mlflow_tracking_uri {
        from_snap.insert("MLFLOW_TRACKING_URI".into(), u.clone());
    }
    for (role, model) in &snap.roles {
        if let (Some(var), Some(model)) = (role_env_var(role), model) {
            from_snap.insert(var, model.clone());
        }
    }
    let relevant = |k: &str| k == "GPUHUB_URL" || k == "MLFLOW_TRACKING_URI" || k.ends_with("_MODEL");
    let mut keys: Vec<&str> = from_snap.keys().map(String::as_str).chain(env.keys().map(String::as_str).filter(|k| relevant(k))).collect();
    keys.sort_unstable();
    keys.dedup();
    let diffs: Vec<String> = keys
        .into_iter()
        .filter_map(|k| {
            let s = from_snap.get(k).map(String::as_str);
            let a = env.get(k).and_then(serde_json::Value::as_str);
            (s != a).then(|| format!("{k} is {} there, {} in the agent", s.unwrap_or("unset"), a.unwrap_or("unset")))
        })
        .collect();
    (!diffs.is_empty()).then(|| diffs.join(", "))
}

/// The job key as the plugin reads it (same rules as `gpuhub-spank`'s `read_job_key`).
pub fn job_key_check(path: &Path) -> Check {
    let p = path.display();
    let recreate = format!("remove {p} and restart gpuhub-agent, which creates a new key (tokens of running jobs stop working)");
    let meta = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return fail(
                "job-key",
                format!("{p} missing: the plugin cannot mint tokens, so new jobs get no gateway credential"),
                "restart gpuhub-agent, which creates the key at start (tokens of running jobs stop working)".into(),
            );
        }
        Err(e) => return fail("job-key", format!("{p}: {e}"), recreate),
        Ok(m) => m,
    };
    if !meta.is_file() {
        return fail("job-key", format!("{p} is not a regular file"), recreate);
    }
    if meta.uid() != 0 || meta.mode() & 0o077 != 0 {
        return fail(
            "job-key",
            format!(
                "{p} is owned by uid {} with mode {:o}: users could read it and mint tokens for anyone, so the plugin refuses it",
                meta.uid(),
                meta.mode() & 0o7777
            ),
            format!("chown root {p} && chmod 600 {p}, then rotate it ({recreate})"),
        );
    }
    let key = match std::fs::read(path) {
        Ok(k) => k,
        Err(e) => return fail("job-key", format!("{p}: {e}"), recreate),
    };
    // The plugin and the agent read the file with the same function (whitespace at both ends
    // trimmed), so a trailing newline is fine.
    let key = match gpuhub_wire::token::parse_key(&key) {
        Ok(k) => k,
        Err(e) => return fail("job-key", format!("{p} {e}, so the plugin refuses it"), recreate),
    };
    pass("job-key", format!("{p} (root, mode {:o}, {} bytes)", meta.mode() & 0o7777, key.len()))
}

/// The SQLite database file behind `store_url` (`None` for other backends: the agent's ping
/// covers a server that went away).
pub fn store_file_check(store_url: &str) -> Option<Check> {
    let rest = store_url.strip_prefix("sqlite://").or_else(|| store_url.strip_prefix("sqlite:"))?;
    let path = Path::new(rest.split('?').next().unwrap_or(rest));
    let p = path.display();
    let restore =
        format!("stop gpuhub-agent, put the newest backup (gpuhub backup; <state_dir>/backups/gpuhub-*.db) in place as {p}, start it");
    let meta = match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Some(fail("store", format!("{p} missing: the agent writes into a deleted file, lost when it restarts"), restore));
        }
        Err(e) => return Some(fail("store", format!("{p}: {e}"), restore)),
        Ok(m) => m,
    };
    if !meta.is_file() {
        return Some(fail("store", format!("{p} is not a regular file"), restore));
    }
    let mut header = [0u8; 16];
    let read = std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut header));
    match read {
        Ok(()) if &header == b"SQLite format 3\0" => Some(pass("store", format!("{p} is an SQLite database"))),
        Ok(()) => Some(fail("store", format!("{p} is corrupt: it does not start with the SQLite header"), restore)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            Some(fail("store", format!("{p} is corrupt: {} bytes, shorter than an SQLite header", meta.len()), restore))
        }
        Err(e) => Some(fail("store", format!("{p}: {e}"), restore)),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn root() -> bool {
        // SAFETY: geteuid has no preconditions.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn spool_missing_not_a_dir_bad_records_and_open_to_users() {
        let d = tempfile::tempdir().unwrap();
        let spool = d.path().join("spool");
        let c = spool_check(&spool);
        assert!(!c.ok && c.detail.contains("missing") && c.fix.as_deref().unwrap().contains("mkdir"), "{c:?}");
        assert!(!spool.exists(), "the check must not create the spool");
        std::fs::write(&spool, "x").unwrap();
        assert!(spool_check(&spool).detail.contains("not a directory"));
        std::fs::remove_file(&spool).unwrap();
        std::fs::create_dir(&spool).unwrap();
        std::fs::set_permissions(&spool, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(spool.join("records"), "x").unwrap();
        let c = spool_check(&spool);
        assert!(!c.ok && c.detail.contains("records is not a directory"), "{c:?}");
        std::fs::remove_file(spool.join("records")).unwrap();
        std::fs::create_dir(spool.join("records")).unwrap();
        if root() {
            assert!(spool_check(&spool).ok, "{:?}", spool_check(&spool));
            std::fs::set_permissions(&spool, std::fs::Permissions::from_mode(0o777)).unwrap();
            assert!(spool_check(&spool).detail.contains("forge"));
        } else {
            assert!(spool_check(&spool).detail.contains("owner uid"), "not owned by root");
        }
    }

    const SNAP: &str = r#"{"version":1,"generated_at":1,"gateway_url":"http://127.0.0.1:8400","mlflow_tracking_uri":null,"mlflow_experiment":null,"roles":{"ocr":"dots.ocr","tts":null},"gpus":{}}"#;

    #[test]
    fn snapshot_missing_corrupt_stale_and_current() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("snapshot.json");
        assert!(snapshot_check(&p, None).detail.contains("missing"));
        std::fs::write(&p, "{\"version\":1,").unwrap();
        let c = snapshot_check(&p, None);
        assert!(!c.ok && c.detail.contains("corrupt") && c.fix.as_deref().unwrap().contains("restart"), "{c:?}");
        std::fs::write(&p, SNAP.replace("\"version\":1", "\"version\":7")).unwrap();
        assert!(snapshot_check(&p, None).detail.contains("version 7"));
        std::fs::write(&p, SNAP).unwrap();
        let now = serde_json::json!({"GPUHUB_URL": "http://127.0.0.1:8400", "OPENAI_BASE_URL": "http://127.0.0.1:8400/v1", "OCR_MODEL": "dots.ocr"});
        assert!(snapshot_check(&p, Some(&now)).ok, "{:?}", snapshot_check(&p, Some(&now)));
        let moved = serde_json::json!({"GPUHUB_URL": "http://127.0.0.1:8400", "OCR_MODEL": "dots.ocr-v2", "TTS_MODEL": "kokoro"});
        let c = snapshot_check(&p, Some(&moved));
        assert!(!c.ok && c.detail.contains("stale"), "{c:?}");
        assert!(c.detail.contains("OCR_MODEL is dots.ocr there, dots.ocr-v2 in the agent"), "{c:?}");
        assert!(c.detail.contains("TTS_MODEL is unset there, kokoro in the agent"), "{c:?}");
    }

    #[test]
    fn job_key_missing_open_short_and_newline_is_fine() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("job-token.key");
        assert!(job_key_check(&p).detail.contains("missing"));
        std::fs::write(&p, "0123456789abcdef0123456789abcdef").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let c = job_key_check(&p);
        assert!(!c.ok && c.fix.as_deref().unwrap().contains("chmod 600"), "{c:?}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        if !root() {
            assert!(job_key_check(&p).detail.contains("owned by uid"), "not owned by root");
            return;
        }
        assert!(job_key_check(&p).ok, "{:?}", job_key_check(&p));
        std::fs::write(&p, "").unwrap();
        assert!(job_key_check(&p).detail.contains("holds 0 bytes"));
        std::fs::write(&p, "0123456789abcdef0123456789abcdef\n").unwrap();
        let c = job_key_check(&p);
        assert!(c.ok && c.detail.contains("32 bytes"), "a trailing newline is not part of the key: {c:?}");
        std::fs::write(&p, "0123456789abcde\n").unwrap();
        assert!(job_key_check(&p).detail.contains("holds 15 bytes"));
    }

    #[test]
    fn store_file_missing_corrupt_and_other_backends() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("gpuhub.db");
        let url = format!("sqlite://{}?mode=rwc", p.display());
        assert!(store_file_check("postgres://u:pw@db/gpuhub").is_none());
        assert!(store_file_check(&url).unwrap().detail.contains("missing"));
        std::fs::write(&p, b"SQLite format 3\0 and pages").unwrap();
        assert!(store_file_check(&url).unwrap().ok);
        std::fs::write(&p, b"garbage garbage garbage").unwrap();
        let c = store_file_check(&url).unwrap();
        assert!(!c.ok && c.detail.contains("corrupt") && c.fix.as_deref().unwrap().contains("backup"), "{c:?}");
        std::fs::write(&p, b"SQL").unwrap();
        assert!(store_file_check(&url).unwrap().detail.contains("shorter"));
    }

    #[test]
    fn a_failing_local_check_replaces_the_agents() {
        let agent = vec![pass("store", "ping ok".into()), pass("spool", "ok".into()), fail("nvml", "x".into(), "y".into())];
        let local =
            vec![fail("store", "gone".into(), "restore".into()), pass("spool", "fine".into()), fail("job-key", "k".into(), "f".into())];
        let m = merge(agent, local);
        let names: Vec<(&str, bool)> = m.iter().map(|c| (c.name.as_str(), c.ok)).collect();
        assert_eq!(names, [("store", false), ("spool", true), ("nvml", false), ("job-key", false)]);
        assert_eq!(m[0].detail, "gone");
    }
}
