//! One accounting "story" run on both backends: SQLite always, PostgreSQL when
//! `GPUHUB_TEST_PG_URL` is set (a uniquely named database per run; `GPUHUB_TEST_KEEP_DB=1`
//! keeps it for inspection).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use gpuhub_wire::spool::{GpuRef, JobIdentity, QUARANTINE_DIR, RECORDS_DIR, Record, record_file_name};
use prometheus_client::registry::Registry;
use serde_json::{Value, json};

use super::api::{LIVE_MAX_AGE_S, add_live, job_json, usage_json};
use super::*;
use crate::control::Caller;
use crate::store::Store;

const S: i64 = 1_000_000;
const U0: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const U1: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";

struct FakeGpus;

impl GpuView for FakeGpus {
    fn known_gpus(&self) -> Option<BTreeMap<u32, String>> {
        Some(BTreeMap::from([(0, U0.to_string()), (1, U1.to_string())]))
    }
    fn job_gpu_stats(&self, job_id: u32) -> Vec<JobGpuStats> {
        if job_id != 11 {
            return Vec::new();
        }
        vec![JobGpuStats {
            gpu_uuid: U0.into(),
            gpu_index: 0,
            mean_util: 42.5,
            peak_vram_bytes: 1 << 30,
            energy_joules: 1234.0,
            samples: 10,
            first_seen: 0,
            last_seen: 0,
            last_util: 77.0,
            last_vram_bytes: 3 << 30,
        }]
    }
}

fn ident(job: u32, uid: u32, user: &str) -> JobIdentity {
    JobIdentity {
        job_id: job,
        uid,
        user: user.into(),
        account: Some(format!("{user}-lab")),
        partition: Some("gpu".into()),
        node: "gpu01".into(),
    }
}

fn g(index: u32, uuid: Option<&str>) -> GpuRef {
    GpuRef { index, uuid: uuid.map(str::to_string) }
}

fn start(t: i64, job: &JobIdentity, gpus: Vec<GpuRef>) -> Record {
    Record::JobStart { v: 1, time_us: t, job: job.clone(), gpus }
}
fn end(t: i64, job: &JobIdentity, gpus: Vec<GpuRef>) -> Record {
    Record::JobEnd { v: 1, time_us: t, job: job.clone(), exit_code: Some(0), gpus }
}
fn step(t: i64, job: &JobIdentity, gpus: Vec<GpuRef>, shards: Option<u32>) -> Record {
    Record::StepStart { v: 1, time_us: t, job: job.clone(), step_id: 0, gpus, shards }
}
fn step_end(t: i64, job: &JobIdentity) -> Record {
    Record::StepEnd { v: 1, time_us: t, job: job.clone(), step_id: 0, exit_status: Some(0) }
}

fn write(spool: &Path, rec: &Record) -> String {
    let dir = spool.join(RECORDS_DIR);
    std::fs::create_dir_all(&dir).unwrap();
    let name = record_file_name(rec, 4242);
    std::fs::write(dir.join(&name), rec.to_json()).unwrap();
    name
}

fn caller(uid: u32, user: &str, admin: bool) -> Caller {
    Caller { uid, user: user.into(), admin }
}

fn row<'a>(v: &'a Value, key: &str) -> &'a Value {
    v["rows"].as_array().unwrap().iter().find(|r| r["key"] == key).unwrap_or_else(|| panic!("no row {key} in {v:#}"))
}

async fn story(store: Store) {
    let spool = tempfile::tempdir().unwrap();
    let t0 = crate::util::now_us() - 3600 * S;
    let (alice, bob, carol, dave, erin, frank, gina) = (
        ident(11, 1001, "alice"),
        ident(12, 1002, "bob"),
        ident(13, 1003, "carol"),
        ident(14, 1004, "dave"),
        ident(15, 1005, "erin"),
        ident(16, 1006, "frank"),
        ident(17, 1007, "gina"),
    );
    // gpu:1 for 100 s, with a step.
    write(spool.path(), &start(t0, &alice, vec![g(0, Some(U0))]));
    write(spool.path(), &step(t0 + S, &alice, vec![g(0, None)], None));
    write(spool.path(), &step_end(t0 + 99 * S, &alice));
    let alice_end = write(spool.path(), &end(t0 + 100 * S, &alice, vec![g(0, Some(U0))]));
    // gpu:2 for 50 s.
    write(spool.path(), &start(t0, &bob, vec![g(0, None), g(1, None)]));
    write(spool.path(), &end(t0 + 50 * S, &bob, vec![g(0, None), g(1, None)]));
    // shard:7 on GPU 1 for 30 s: the prolog sees one GPU, the step the shard count.
    write(spool.path(), &start(t0, &carol, vec![g(1, None)]));
    write(spool.path(), &step(t0 + S, &carol, vec![g(1, None)], Some(7)));
    write(spool.path(), &end(t0 + 30 * S, &carol, vec![g(1, None)]));
    // CPU only.
    write(spool.path(), &start(t0, &dave, vec![]));
    write(spool.path(), &end(t0 + 20 * S, &dave, vec![]));
    // A GPU NVML does not know.
    write(spool.path(), &start(t0, &erin, vec![g(7, None)]));
    write(spool.path(), &end(t0 + 10 * S, &erin, vec![g(7, None)]));
    // The clock went backwards between start and end.
    write(spool.path(), &start(t0 + 50 * S, &frank, vec![g(0, None)]));
    write(spool.path(), &end(t0 + 40 * S, &frank, vec![g(0, None)]));
    // Never ends: the node reboots.
    write(spool.path(), &start(t0, &gina, vec![g(0, None)]));
    // Not records: corrupt, a future version, a huge file; and a temp file in flight.
    let records = spool.path().join(RECORDS_DIR);
    std::fs::write(records.join("00000000000000000001-garbage.json"), "{not json").unwrap();
    std::fs::write(records.join("00000000000000000002-v99.json"), start(t0, &alice, vec![]).to_json().replace("\"v\":1", "\"v\":99"))
        .unwrap();
    std::fs::write(records.join("00000000000000000003-huge.json"), vec![b' '; 2 * 1024 * 1024]).unwrap();
    // Hand-made records past the plugin's bounds: a 3 KB user name (over PostgreSQL's index entry
    // limit) and a control character in the account. Quarantined; the others still ingest.
    let mut long = ident(18, 1008, "h");
    long.user = "u".repeat(3 * 1024);
    std::fs::write(records.join("00000000000000000005-long-user.json"), start(t0, &long, vec![]).to_json()).unwrap();
    let mut ctl = ident(19, 1009, "i");
    ctl.account = Some("lab\u{1b}[2J".into());
    std::fs::write(records.join("00000000000000000006-control.json"), start(t0, &ctl, vec![]).to_json()).unwrap();
    std::fs::write(records.join(".00000000000000000004-inflight.tmp"), "{").unwrap();

    let mut registry = Registry::default();
    let metrics = AccountingMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
    let mut ing = Ingestor::new(store.clone(), spool.path(), Arc::new(FakeGpus), metrics);
    let report = ing.pass().await;
    assert_eq!((report.ingested, report.duplicates, report.quarantined, report.left), (16, 0, 5, 0), "{report:?}");
    let left: Vec<_> = std::fs::read_dir(&records).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(left, vec![".00000000000000000004-inflight.tmp"], "only the file in flight stays");
    let q = spool.path().join(QUARANTINE_DIR);
    let reason = std::fs::read_to_string(q.join("00000000000000000001-garbage.json.reason")).unwrap();
    assert!(reason.contains("not a gpuhub usage record"), "{reason}");
    assert!(std::fs::read_to_string(q.join("00000000000000000002-v99.json.reason")).unwrap().contains("version 99"));
    assert!(std::fs::read_to_string(q.join("00000000000000000003-huge.json.reason")).unwrap().contains("larger than any record"));
    let reason = std::fs::read_to_string(q.join("00000000000000000005-long-user.json.reason")).unwrap();
    assert!(reason.contains("field `user` is 3072 bytes long, over the 64-byte limit"), "{reason}");
    let reason = std::fs::read_to_string(q.join("00000000000000000006-control.json.reason")).unwrap();
    assert!(reason.contains("field `account` holds a control character") && !reason.contains("[2J"), "{reason}");
    assert_eq!(std::fs::read_to_string(q.join("00000000000000000001-garbage.json")).unwrap(), "{not json", "kept as it was");

    // The node rebooted 500 s after t0; the agent's last heartbeat was at t0 + 300 s.
    ing.close_after_reboot(t0 + 500 * S, Some(t0 + 300 * S)).await;

    let admin = caller(0, "root", true);
    let pool = store.pool();
    let v = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
    let num = |r: &Value, k: &str| r[k].as_f64().unwrap();
    assert_eq!(num(row(&v, "alice"), "gpu_seconds"), 100.0);
    assert_eq!(num(row(&v, "bob"), "gpu_seconds"), 100.0);
    assert_eq!(num(row(&v, "carol"), "gpu_seconds"), 0.0);
    assert_eq!(num(row(&v, "carol"), "shard_seconds"), 210.0);
    assert_eq!(num(row(&v, "carol"), "gpu_equivalent_seconds"), 15.0);
    assert_eq!(num(row(&v, "dave"), "gpu_seconds"), 0.0);
    assert_eq!(row(&v, "dave")["jobs"], 1);
    assert_eq!(num(row(&v, "erin"), "gpu_seconds"), 10.0, "an unknown GPU is still accounted");
    assert_eq!(num(row(&v, "frank"), "gpu_seconds"), 0.0, "end before start counts zero");
    assert_eq!(num(row(&v, "gina"), "gpu_seconds"), 300.0, "closed at the last heartbeat");
    assert_eq!(num(&v["total"], "gpu_seconds"), 510.0);
    assert_eq!(num(&v["total"], "gpu_equivalent_seconds"), 525.0);
    assert_eq!(row(&v, "alice")["user"], "alice", "rows also carry the --by field by name");

    let by_gpu = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::Gpu, 14).await.unwrap();
    assert_eq!(num(row(&by_gpu, "gpu0"), "gpu_seconds"), 100.0 + 50.0 + 300.0);
    assert_eq!(num(row(&by_gpu, "gpu1"), "gpu_seconds"), 50.0);
    assert_eq!(num(row(&by_gpu, "gpu1"), "shard_seconds"), 210.0);
    assert_eq!(num(row(&by_gpu, "gpu7"), "gpu_seconds"), 10.0);
    let by_account = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::Account, 14).await.unwrap();
    assert_eq!(num(row(&by_account, "bob-lab"), "gpu_seconds"), 100.0);
    let by_part = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::Partition, 14).await.unwrap();
    assert_eq!(num(row(&by_part, "gpu"), "gpu_seconds"), 510.0);
    // A window that starts after everything ended.
    let recent = usage_json(pool, &admin, "10m", 600, UsageBy::User, 14).await.unwrap();
    assert!(recent["rows"].as_array().unwrap().is_empty(), "{recent:#}");

    // A user sees their own jobs only.
    let mine = usage_json(pool, &caller(1001, "alice", false), "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
    assert_eq!(mine["rows"].as_array().unwrap().len(), 1, "{mine:#}");
    assert_eq!(num(row(&mine, "alice"), "gpu_seconds"), 100.0);
    assert!(job_json(pool, &caller(1002, "bob", false), 11, 14).await.unwrap().is_none(), "bob cannot see alice's job");

    // The job summary, with what NVML measured.
    let j = job_json(pool, &caller(1001, "alice", false), 11, 14).await.unwrap().unwrap();
    let n = &j["nodes"][0];
    assert_eq!(n["state"], "ended");
    assert_eq!(n["gpu_seconds"].as_f64(), Some(100.0));
    assert_eq!(n["gpus"][0]["uuid"], U0);
    assert_eq!(n["gpus"][0]["mean_util"].as_f64(), Some(42.5));
    assert_eq!(n["gpus"][0]["peak_vram_bytes"].as_i64(), Some(1 << 30));
    let c = job_json(pool, &admin, 13, 14).await.unwrap().unwrap();
    assert_eq!(c["nodes"][0]["shards"], 7);
    assert_eq!(c["nodes"][0]["gpus"][0]["uuid"], U1, "UUID filled in from NVML when the record had none");
    for (id, want) in [(15, "unknown_gpu"), (16, "clock_backwards"), (17, "never_ended")] {
        let j = job_json(pool, &admin, id, 14).await.unwrap().unwrap();
        let kinds: Vec<&str> = j["nodes"][0]["anomalies"].as_array().unwrap().iter().map(|a| a["kind"].as_str().unwrap()).collect();
        assert_eq!(kinds, vec![want], "job {id}");
    }
    assert_eq!(job_json(pool, &admin, 17, 14).await.unwrap().unwrap()["nodes"][0]["state"], "closed_after_reboot");

    // Crash between commit and unlink: the file comes back. It is a duplicate, nothing changes.
    std::fs::write(records.join(&alice_end), end(t0 + 100 * S, &alice, vec![g(0, Some(U0))]).to_json()).unwrap();
    let report = ing.pass().await;
    assert_eq!((report.ingested, report.duplicates), (0, 1), "{report:?}");
    assert!(!records.join(&alice_end).exists());
    let again = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
    assert_eq!(again["rows"], v["rows"], "re-reading a record must not count it twice");
    assert_eq!(db::record_count(pool).await.unwrap(), 16);

    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    for line in [
        "gpuhub_accounting_records_quarantined_total 5",
        "gpuhub_accounting_records_duplicate_total 1",
        "gpuhub_accounting_anomalies_total{kind=\"unknown_gpu\"} 1",
        "gpuhub_accounting_anomalies_total{kind=\"clock_backwards\"} 1",
        "gpuhub_accounting_anomalies_total{kind=\"never_ended\"} 1",
        "gpuhub_accounting_records_ingested_total{kind=\"job_start\"} 7",
    ] {
        assert!(text.lines().any(|l| l == line), "missing `{line}` in\n{text}");
    }
}

#[tokio::test]
async fn story_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("acct.db").display());
    let store = Store::open(&url, None).await.unwrap();
    story(store).await;
}

#[tokio::test]
async fn story_postgres() {
    let Some(admin_url) = crate::store::testing::pg_url("story_postgres") else {
        return;
    };
    sqlx::any::install_default_drivers();
    let name = format!("gpuhub_acct_{}_{}", std::process::id(), crate::util::now_us() % 1_000_000);
    let admin = sqlx::AnyPool::connect(&admin_url).await.unwrap();
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&admin).await.unwrap();
    let base = admin_url.rsplit_once('/').map_or(admin_url.as_str(), |(b, _)| b);
    let store = Store::open(&format!("{base}/{name}"), Some(4)).await.unwrap();
    story(store.clone()).await;
    store.close().await;
    if std::env::var("GPUHUB_TEST_KEEP_DB").as_deref() != Ok("1") {
        sqlx::query(&format!("DROP DATABASE {name} WITH (FORCE)")).execute(&admin).await.unwrap();
    } else {
        eprintln!("kept database {name}");
    }
}

// ---- Reconciliation with Slurm: a fake Slurm state, the real ingest and store.

mod reconcile_story {
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::Mutex;

    use super::*;
    use crate::accounting::ingest::SlurmLink;
    use crate::accounting::reconcile::{self, Action, Inputs};
    use crate::accounting::slurm::{NodeAlloc, SlurmJob, SlurmSource, SlurmState, Source};
    use crate::config::JobBoundaries;

    /// What Slurm says, and the ids each look asked about.
    struct FakeSlurm(Mutex<SlurmState>, Mutex<Vec<Vec<u32>>>);

    impl FakeSlurm {
        /// Whether the looks since the last call asked about `id`.
        fn asked_about(&self, id: u32) -> bool {
            std::mem::take(&mut *self.1.lock().unwrap()).iter().any(|w| w.contains(&id))
        }
    }

    impl SlurmSource for FakeSlurm {
        fn query(&self, want: &[u32], _since: Option<i64>) -> SlurmState {
            self.1.lock().unwrap().push(want.to_vec());
            let mut st = self.0.lock().unwrap().clone();
            if st.taken_us == 0 {
                st.taken_us = crate::util::now_us();
            }
            st
        }
    }

    fn sj(id: u32, source: Source, state: &str, start: i64, end: Option<i64>, gpus: u32, shards: u32) -> SlurmJob {
        SlurmJob {
            job_id: id,
            source,
            state: state.into(),
            user: "gpuhublab".into(),
            uid: Some(1001),
            account: None,
            partition: Some("gpu".into()),
            node_list: "gpu01".into(),
            start_us: Some(start),
            end_us: end,
            gpus,
            shards,
            cpus: 1,
            mem_bytes: 500 << 20,
            reason: None,
            per_node: BTreeMap::new(),
        }
    }

    fn indexed(mut j: SlurmJob, gpus: &[u32], shards: &[(u32, u32)]) -> SlurmJob {
        j.per_node.insert("gpu01".into(), NodeAlloc { gpus: gpus.iter().copied().collect(), shards: shards.iter().copied().collect() });
        j
    }

    fn kinds(n: &Value) -> Vec<String> {
        n["anomalies"].as_array().unwrap().iter().map(|a| a["kind"].as_str().unwrap().to_string()).collect()
    }

    fn field<'a>(n: &'a Value, f: &str) -> Option<&'a Value> {
        n["anomalies"].as_array().unwrap().iter().find(|a| a["field"] == f)
    }

    async fn story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        // Slurm keeps whole seconds.
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = |job: u32, user: &str| JobIdentity { user: user.into(), ..ident(job, 1001, user) };
        // 21: gpu:2 with SLURM_SHARDS_ON_NODE=1 pre-set: the step claims 1 shard.
        let j21 = lab(21, "gpuhublab");
        write(spool.path(), &start(t0 + 10 * S, &j21, vec![g(0, None), g(1, None)]));
        write(spool.path(), &step(t0 + 11 * S, &j21, vec![g(0, None), g(1, None)], Some(1)));
        // 22: ended, records claim user bob and account bob-lab; Slurm: gpuhublab, no account.
        let j22 = lab(22, "bob");
        write(spool.path(), &start(t0 + 5 * S, &j22, vec![g(0, None)]));
        write(spool.path(), &end(t0 + 8 * S + 200_000, &j22, vec![g(0, None)]));
        // 23: its end record never arrives; sacct says it ended at t0 + 50 s.
        let j23 = lab(23, "gpuhublab");
        write(spool.path(), &start(t0 + 20 * S, &j23, vec![g(1, None)]));
        // 25: nobody in Slurm knows it.
        let j25 = lab(25, "gpuhublab");
        write(spool.path(), &start(t0 + 40 * S, &j25, vec![g(0, None)]));
        write(spool.path(), &end(t0 + 45 * S, &j25, vec![g(0, None)]));
        // 24 runs on the node with no record at all (spool unwritable).
        let st = SlurmState {
            taken_us: 0,
            ctld_ok: true,
            acct_ok: true,
            ctld: BTreeMap::from([
                (21, indexed(sj(21, Source::Slurmctld, "RUNNING", t0 + 10 * S, Some(t0 + 130 * S), 2, 0), &[0, 1], &[])),
                (22, sj(22, Source::Slurmctld, "COMPLETED", t0 + 5 * S, Some(t0 + 8 * S), 1, 0)),
                (24, indexed(sj(24, Source::Slurmctld, "RUNNING", t0 + 30 * S, Some(t0 + 150 * S), 0, 3), &[], &[(1, 3)])),
                // Before the agent watched: not created.
                (20, sj(20, Source::Slurmctld, "COMPLETED", t0 - 100 * S, Some(t0 - 90 * S), 1, 0)),
            ]),
            acct: BTreeMap::from([(23, sj(23, Source::Sacct, "CANCELLED", t0 + 20 * S, Some(t0 + 50 * S), 1, 0))]),
            ..SlurmState::default()
        };
        let fake = Arc::new(FakeSlurm(Mutex::new(st), Mutex::default()));
        let mut registry = Registry::default();
        let metrics = AccountingMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
        // The job-hooks build's records: a job Slurm fills in or closes is an anomaly.
        let link = SlurmLink {
            source: fake.clone(),
            node: "gpu01".into(),
            interval: std::time::Duration::from_secs(1),
            boundaries: JobBoundaries::Prolog,
            job_map_dir: None,
        };
        let mut ing = Ingestor::new(store.clone(), spool.path(), Arc::new(FakeGpus), metrics).with_slurm(link);
        ing.start_watching(None).await;
        ing.tick(true).await;
        ing.tick(true).await;
        let admin = caller(0, "root", true);
        let pool = store.pool();
        let node = |id: u32| {
            let pool = pool.clone();
            let admin = admin.clone();
            async move { job_json(&pool, &admin, id, 14).await.unwrap().unwrap_or_else(|| panic!("no job {id}"))["nodes"][0].clone() }
        };

        let n = node(21).await;
        assert_eq!((n["verified"].as_str(), n["gpu_count"].as_i64(), n["shards"].as_i64()), (Some("slurmctld"), Some(2), Some(0)), "{n:#}");
        assert_eq!(n["shard_seconds"].as_f64(), Some(0.0), "{n:#}");
        let d = field(&n, "shards").unwrap_or_else(|| panic!("no shards disagreement: {n:#}"));
        assert_eq!((d["claimed"].as_str(), d["slurm"].as_str(), d["used"].as_str()), (Some("1"), Some("0"), Some("0")));
        assert_eq!(field(&n, "gpus").unwrap()["slurm"], "2");

        let n = node(22).await;
        assert_eq!((n["user"].as_str(), n["account"].as_str()), (Some("gpuhublab"), None), "{n:#}");
        assert_eq!(field(&n, "user").unwrap()["claimed"], "bob");
        assert_eq!(field(&n, "account").unwrap()["claimed"], "bob-lab");
        assert!((n["gpu_seconds"].as_f64().unwrap() - 3.2).abs() < 1e-6, "the epilog's end is within Slurm's: {n:#}");

        let n = node(23).await;
        assert_eq!(n["state"], "closed_from_slurm", "{n:#}");
        assert_eq!(n["end_us"].as_i64(), Some(t0 + 50 * S), "sacct's End");
        assert!(kinds(&n).contains(&"end_from_slurm".to_string()), "{n:#}");
        assert_eq!(n["gpu_seconds"].as_f64(), Some(30.0));

        let n = node(24).await;
        assert_eq!((n["state"].as_str(), n["start_us"].as_i64()), (Some("running"), Some(t0 + 30 * S)), "{n:#}");
        assert_eq!((n["shards"].as_i64(), n["gpus"][0]["index"].as_i64(), n["gpus"][0]["shards"].as_i64()), (Some(3), Some(1), Some(3)));
        assert_eq!(kinds(&n), vec!["start_from_slurm"]);
        assert!(job_json(pool, &admin, 20, 14).await.unwrap().is_none(), "a job from before the agent watched is not created");

        let n = node(25).await;
        assert_eq!(n["verified"], "unverified", "{n:#}");
        assert_eq!(kinds(&n), vec!["unverified"]);
        assert_eq!(n["gpu_seconds"].as_f64(), Some(5.0), "its records stand");

        // Late records: idempotent, the record's time only within Slurm's bounds.
        let before = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
        write(spool.path(), &end(t0 + 50 * S + 300_000, &j23, vec![g(1, None)]));
        let j24 = lab(24, "gpuhublab");
        write(spool.path(), &start(t0 + S, &j24, vec![g(1, None)]));
        write(spool.path(), &step(t0 + 31 * S, &j24, vec![g(1, None)], Some(5)));
        ing.tick(false).await;
        let n = node(23).await;
        assert_eq!((n["state"].as_str(), n["end_us"].as_i64()), (Some("ended"), Some(t0 + 50 * S + 300_000)), "{n:#}");
        assert!(!kinds(&n).contains(&"end_from_slurm".to_string()), "the end record arrived after all: {n:#}");
        let n = node(24).await;
        assert_eq!(n["start_us"].as_i64(), Some(t0 + 30 * S), "a start 29 s before Slurm's is not used: {n:#}");
        assert!(field(&n, "start").is_some() && field(&n, "shards").is_some(), "{n:#}");
        assert_eq!(n["shards"].as_i64(), Some(3));
        let after = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
        assert_eq!(before["rows"][0]["jobs"], after["rows"][0]["jobs"], "no job counted twice");

        // A job closed from Slurm stays closed; a third tick changes nothing.
        ing.tick(true).await;
        assert_eq!(node(23).await["end_us"].as_i64(), Some(t0 + 50 * S + 300_000));

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for line in [
            "gpuhub_accounting_slurm_disagreements_total{field=\"shards\"} 2",
            "gpuhub_accounting_slurm_disagreements_total{field=\"user\"} 1",
            "gpuhub_accounting_anomalies_total{kind=\"end_from_slurm\"} 1",
            "gpuhub_accounting_anomalies_total{kind=\"start_from_slurm\"} 1",
            "gpuhub_accounting_anomalies_total{kind=\"unverified\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "missing `{line}` in\n{text}");
        }
    }

    /// As shipped: step records only, job boundaries from Slurm. Creating and closing jobs from
    /// Slurm is the normal path (no anomaly), the job's measurements are stored at the close,
    /// and the dcgm job map follows slurmctld's allocations.
    async fn slurm_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let map = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = |job: u32| JobIdentity { account: None, partition: None, ..ident(job, 1001, "gpuhublab") };
        // 11: gpu:1 (FakeGpus has measurements for it), with its step records.
        write(spool.path(), &step(t0 + 11 * S, &lab(11), vec![g(0, None)], None));
        write(spool.path(), &step_end(t0 + 40 * S, &lab(11)));
        // 33: gpu:2, running, with a step; 32: shard:3 on GPU 1, an salloc without any record;
        // 34: running now, then slurmctld forgets it and there is no sacct.
        write(spool.path(), &step(t0 + 61 * S, &lab(33), vec![g(0, None), g(1, None)], None));
        let running = BTreeMap::from([
            (11, indexed(sj(11, Source::Slurmctld, "RUNNING", t0 + 10 * S, Some(t0 + 130 * S), 1, 0), &[0], &[])),
            (32, indexed(sj(32, Source::Slurmctld, "RUNNING", t0 + 20 * S, Some(t0 + 140 * S), 0, 3), &[], &[(1, 3)])),
            (33, indexed(sj(33, Source::Slurmctld, "RUNNING", t0 + 60 * S, Some(t0 + 180 * S), 2, 0), &[0, 1], &[])),
            (34, indexed(sj(34, Source::Slurmctld, "RUNNING", t0 + 70 * S, Some(t0 + 190 * S), 0, 2), &[], &[(1, 2)])),
        ]);
        let st = SlurmState { taken_us: 0, ctld_ok: true, acct_ok: true, ctld: running, ..SlurmState::default() };
        let fake = Arc::new(FakeSlurm(Mutex::new(st), Mutex::default()));
        let mut registry = Registry::default();
        let metrics = AccountingMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
        let link = || SlurmLink {
            source: fake.clone(),
            node: "gpu01".into(),
            interval: std::time::Duration::from_secs(1),
            boundaries: JobBoundaries::Slurm,
            job_map_dir: Some(map.path().to_path_buf()),
        };
        let mut ing = Ingestor::new(store.clone(), spool.path(), Arc::new(FakeGpus), metrics).with_slurm(link());
        ing.start_watching(None).await;
        ing.tick(true).await;
        let read = |gpu: u32| std::fs::read_to_string(map.path().join(gpu.to_string())).unwrap_or_default();
        assert_eq!((read(0).as_str(), read(1).as_str()), ("11\n33\n", "32\n33\n34\n"), "the job map follows slurmctld");

        // 11 ends (slurmctld's EndTime), 33 ends and slurmctld forgot it (sacct's End), 34 is
        // forgotten with no end anywhere; 32 still runs.
        {
            let mut st = fake.0.lock().unwrap();
            st.ctld.remove(&33);
            st.ctld.remove(&34);
            let j11 = st.ctld.get_mut(&11).unwrap();
            (j11.state, j11.end_us) = ("COMPLETED".into(), Some(t0 + 41 * S));
            st.acct.insert(33, sj(33, Source::Sacct, "COMPLETED", t0 + 60 * S, Some(t0 + 90 * S), 2, 0));
        }
        ing.tick(true).await;
        let admin = caller(0, "root", true);
        let pool = store.pool();
        let node = |id: u32| {
            let pool = pool.clone();
            let admin = admin.clone();
            async move { job_json(&pool, &admin, id, 14).await.unwrap().unwrap_or_else(|| panic!("no job {id}"))["nodes"][0].clone() }
        };
        let n = node(11).await;
        assert_eq!(
            (n["state"].as_str(), n["start_us"].as_i64(), n["end_us"].as_i64()),
            (Some("ended"), Some(t0 + 10 * S), Some(t0 + 41 * S)),
            "{n:#}"
        );
        assert!(kinds(&n).is_empty(), "the normal path is no anomaly: {n:#}");
        assert_eq!(n["gpu_seconds"].as_f64(), Some(31.0));
        assert_eq!(n["gpus"][0]["mean_util"].as_f64(), Some(42.5), "measurements stored at the close: {n:#}");
        let n = node(33).await;
        assert_eq!(
            (n["state"].as_str(), n["end_us"].as_i64(), n["gpu_seconds"].as_f64()),
            (Some("ended"), Some(t0 + 90 * S), Some(60.0)),
            "{n:#}"
        );
        assert!(kinds(&n).is_empty(), "{n:#}");
        let n = node(32).await;
        assert_eq!(
            (n["state"].as_str(), n["shards"].as_i64(), n["start_us"].as_i64()),
            (Some("running"), Some(3), Some(t0 + 20 * S)),
            "{n:#}"
        );
        assert!(kinds(&n).is_empty(), "an salloc without records is created from Slurm, no anomaly: {n:#}");
        let n = node(34).await;
        assert_eq!(n["state"], "ended", "{n:#}");
        assert_eq!(kinds(&n), vec!["end_approximate"], "{n:#}");
        assert_eq!((read(0).as_str(), read(1).as_str()), ("", "32\n"), "ended jobs leave the map");

        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(!text.contains("kind=\"end_from_slurm\"") && !text.contains("kind=\"start_from_slurm\""), "{text}");
        assert!(text.lines().any(|l| l == "gpuhub_accounting_anomalies_total{kind=\"end_approximate\"} 1"), "{text}");

        // 35 runs (created from Slurm, then listed by a second look); the agent stops, the job
        // ends while it is down, and neither slurmctld nor sacct knows it after the restart:
        // closed at the last look that listed it (kept on the row), not at the restart.
        let now = crate::util::now_us();
        let listed_at = now + 10 * S;
        {
            let mut st = fake.0.lock().unwrap();
            st.taken_us = now;
            st.ctld.insert(35, sj(35, Source::Slurmctld, "RUNNING", t0 + 200 * S, Some(t0 + 5000 * S), 1, 0));
        }
        ing.tick(true).await;
        fake.0.lock().unwrap().taken_us = listed_at;
        ing.tick(true).await;
        drop(ing);
        {
            let mut st = fake.0.lock().unwrap();
            st.taken_us = now + 1000 * S;
            st.ctld.remove(&35);
        }
        let metrics = AccountingMetrics::register(Registry::default().sub_registry_with_prefix("gpuhub"));
        let mut ing = Ingestor::new(store.clone(), spool.path(), Arc::new(FakeGpus), metrics).with_slurm(link());
        ing.start_watching(Some(listed_at)).await;
        ing.tick(true).await;
        let n = node(35).await;
        assert_eq!((n["state"].as_str(), n["end_us"].as_i64()), (Some("ended"), Some(listed_at)), "{n:#}");
        assert_eq!(kinds(&n), vec!["end_approximate"], "{n:#}");
    }

    /// An ingestor of `spool` that reconciles with a fake Slurm in state `st` (returned, to
    /// change), watching from now on.
    async fn watching(store: &Store, spool: &Path, st: SlurmState) -> (Arc<FakeSlurm>, Ingestor) {
        let fake = Arc::new(FakeSlurm(Mutex::new(st), Mutex::default()));
        let metrics = AccountingMetrics::register(Registry::default().sub_registry_with_prefix("gpuhub"));
        let link = SlurmLink {
            source: fake.clone(),
            node: "gpu01".into(),
            interval: std::time::Duration::from_secs(1),
            boundaries: JobBoundaries::Slurm,
            job_map_dir: None,
        };
        let mut ing = Ingestor::new(store.clone(), spool, Arc::new(FakeGpus), metrics).with_slurm(link);
        ing.start_watching(None).await;
        (fake, ing)
    }

    /// A job Slurm requeues runs again under its id: every run is billed, with its own GPUs,
    /// whether its records arrive (41) or only Slurm shows it (42, no record of its second run;
    /// 43, no record at all, as shipped: its first run ends at sacct's End of that run).
    async fn requeue_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = |job: u32| JobIdentity { account: None, partition: None, ..ident(job, 1001, "gpuhublab") };
        // First runs: 41 on GPU 0 for 30 s, 42 on GPU 1 for 20 s, records and Slurm agree.
        write(spool.path(), &start(t0 + 10 * S, &lab(41), vec![g(0, None)]));
        write(spool.path(), &start(t0 + 10 * S, &lab(42), vec![g(1, None)]));
        let st = SlurmState {
            taken_us: 0,
            ctld_ok: true,
            acct_ok: true,
            ctld: BTreeMap::from([
                (41, indexed(sj(41, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[0], &[])),
                (42, indexed(sj(42, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[1], &[])),
                (43, indexed(sj(43, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[0], &[])),
            ]),
            ..SlurmState::default()
        };
        let (fake, mut ing) = watching(&store, spool.path(), st).await;
        ing.tick(true).await;
        // `scontrol requeue`: the epilogs write the ends, Slurm holds both pending.
        write(spool.path(), &end(t0 + 40 * S, &lab(41), vec![g(0, None)]));
        write(spool.path(), &end(t0 + 30 * S, &lab(42), vec![g(1, None)]));
        {
            let mut st = fake.0.lock().unwrap();
            for id in [41, 42, 43] {
                let j = st.ctld.get_mut(&id).unwrap();
                (j.state, j.node_list, j.start_us) = ("PENDING".into(), String::new(), None);
                j.per_node.clear();
            }
            st.ended_runs.insert(43, vec![sj(43, Source::Sacct, "REQUEUED", t0 + 10 * S, Some(t0 + 25 * S), 1, 0)]);
        }
        ing.tick(true).await;
        // Second runs, on the other GPU each: 41 with its records, 42 seen by Slurm only.
        write(spool.path(), &start(t0 + 100 * S, &lab(41), vec![g(1, None)]));
        {
            let mut st = fake.0.lock().unwrap();
            st.ctld.insert(41, indexed(sj(41, Source::Slurmctld, "RUNNING", t0 + 100 * S, None, 1, 0), &[1], &[]));
            st.ctld.insert(42, indexed(sj(42, Source::Slurmctld, "RUNNING", t0 + 90 * S, None, 1, 0), &[0], &[]));
            st.ctld.insert(43, indexed(sj(43, Source::Slurmctld, "RUNNING", t0 + 95 * S, None, 1, 0), &[0], &[]));
            st.ended_runs.clear();
        }
        ing.tick(true).await;
        let pool = store.pool();
        assert!(!store.job_ended(41, 1001).await.unwrap(), "the second run's credential still works");
        write(spool.path(), &end(t0 + 160 * S, &lab(41), vec![g(1, None)]));
        {
            let mut st = fake.0.lock().unwrap();
            for (id, end) in [(41, 160), (42, 190), (43, 125)] {
                let j = st.ctld.get_mut(&id).unwrap();
                (j.state, j.end_us) = ("COMPLETED".into(), Some(t0 + end * S));
            }
        }
        ing.tick(true).await;
        let admin = caller(0, "root", true);
        /// Run, state, start and end (seconds after t0), GPU-seconds, GPU indices, anomalies.
        type Run = (i64, String, i64, i64, f64, Vec<i64>, Vec<String>);
        let runs = |v: Value| -> Vec<Run> {
            v["nodes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| {
                    (
                        n["run"].as_i64().unwrap(),
                        n["state"].as_str().unwrap().to_string(),
                        (n["start_us"].as_i64().unwrap() - t0) / S,
                        (n["end_us"].as_i64().unwrap_or(t0) - t0) / S,
                        n["gpu_seconds"].as_f64().unwrap(),
                        n["gpus"].as_array().unwrap().iter().map(|g| g["index"].as_i64().unwrap()).collect(),
                        kinds(n),
                    )
                })
                .collect()
        };
        let ended = || "ended".to_string();
        let v = job_json(pool, &admin, 41, 14).await.unwrap().unwrap();
        let ok = Vec::new;
        assert_eq!(runs(v.clone()), vec![(0, ended(), 10, 40, 30.0, vec![0], ok()), (1, ended(), 100, 160, 60.0, vec![1], ok())], "{v:#}");
        let v = job_json(pool, &admin, 42, 14).await.unwrap().unwrap();
        assert_eq!(runs(v.clone()), vec![(0, ended(), 10, 30, 20.0, vec![1], ok()), (1, ended(), 90, 190, 100.0, vec![0], ok())], "{v:#}");
        let v = job_json(pool, &admin, 43, 14).await.unwrap().unwrap();
        assert_eq!(runs(v.clone()), vec![(0, ended(), 10, 25, 15.0, vec![0], ok()), (1, ended(), 95, 125, 30.0, vec![0], ok())], "{v:#}");
        let v = usage_json(pool, &admin, "30d", 30 * 86_400, UsageBy::User, 14).await.unwrap();
        assert_eq!(row(&v, "gpuhublab")["gpu_seconds"].as_f64(), Some(30.0 + 60.0 + 20.0 + 100.0 + 15.0 + 30.0), "{v:#}");
        assert_eq!(row(&v, "gpuhublab")["jobs"], 6, "each run counts: {v:#}");
        assert!(store.job_ended(41, 1001).await.unwrap());
        // A pass that reads everything again changes nothing (no third run).
        ing.tick(true).await;
        assert_eq!(job_json(pool, &admin, 42, 14).await.unwrap().unwrap()["nodes"].as_array().unwrap().len(), 2);
    }

    /// A job requeued from this node (gpu01 crashed, or its agent was down) that Slurm lists
    /// running (45) or ended (44) on gpu02 at the agent's next look, with no end record here: its run here
    /// ends at sacct's End of that run (`--duplicates`), exactly, and keeps its own start (45:
    /// its record's, within that run's bounds) and GPUs, whether it was verified before (44) or
    /// not (45): slurmctld's line describes the run on gpu02.
    async fn requeued_to_another_node_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = |job: u32| JobIdentity { account: None, partition: None, ..ident(job, 1001, "gpuhublab") };
        write(spool.path(), &start(t0 + 10 * S, &lab(44), vec![g(0, None)]));
        let here = indexed(sj(44, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[0], &[]);
        let st = SlurmState { taken_us: 0, ctld_ok: true, acct_ok: true, ctld: BTreeMap::from([(44, here)]), ..SlurmState::default() };
        let (fake, mut ing) = watching(&store, spool.path(), st).await;
        ing.tick(true).await;
        write(spool.path(), &start(t0 + 12 * S, &lab(45), vec![g(1, None)]));
        {
            let mut st = fake.0.lock().unwrap();
            // 44's second run has ended on gpu02 too: its EndTime is not this run's.
            for (id, gpu, start, end) in [(44, 1, 30, Some(t0 + 40 * S)), (45, 0, 31, None)] {
                let state = if end.is_some() { "COMPLETED" } else { "RUNNING" };
                let mut elsewhere = sj(id, Source::Slurmctld, state, t0 + start * S, end, 1, 0);
                elsewhere.node_list = "gpu02".into();
                elsewhere.per_node.insert("gpu02".into(), NodeAlloc { gpus: [gpu].into_iter().collect(), shards: BTreeMap::new() });
                st.ctld.insert(id, elsewhere);
                st.ended_runs.insert(id, vec![sj(id, Source::Sacct, "NODE_FAIL", t0 + (10 + id as i64 - 44) * S, Some(t0 + 25 * S), 1, 0)]);
            }
        }
        // The first pass stores 45's record (and verifies it), the second closes it.
        ing.tick(true).await;
        ing.tick(true).await;
        let admin = caller(0, "root", true);
        for (id, start) in [(44, 10), (45, 12)] {
            let n = job_json(store.pool(), &admin, id, 14).await.unwrap().unwrap()["nodes"][0].clone();
            let got = (
                n["node"].as_str(),
                n["state"].as_str(),
                (n["start_us"].as_i64().unwrap_or(0) - t0) / S,
                (n["end_us"].as_i64().unwrap_or(0) - t0) / S,
                n["gpu_seconds"].as_f64(),
                kinds(&n),
            );
            assert_eq!(got, (Some("gpu01"), Some("ended"), start, 25, Some((25 - start) as f64), Vec::<String>::new()), "job {id}: {n:#}");
        }
    }

    #[tokio::test]
    async fn a_run_requeued_to_another_node_ends_at_its_own_end_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            requeued_to_another_node_story(store).await;
        }
    }

    /// A job whose first look did not list it (marked `unverified`), then listed and ended:
    /// billed as Slurm allocated it, and its records' claims still count as disagreements.
    async fn late_listing_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = JobIdentity { account: None, partition: None, ..ident(51, 1001, "gpuhublab") };
        // SLURM_SHARDS_ON_NODE=1 pre-set on a gpu:2 job.
        write(spool.path(), &step(t0 + 10 * S, &lab, vec![g(0, None), g(1, None)], Some(1)));
        let st = SlurmState { taken_us: 0, ctld_ok: true, acct_ok: true, ..SlurmState::default() };
        let (fake, mut ing) = watching(&store, spool.path(), st).await;
        ing.tick(true).await;
        let admin = caller(0, "root", true);
        let n = job_json(store.pool(), &admin, 51, 14).await.unwrap().unwrap()["nodes"][0].clone();
        assert_eq!(n["verified"], "unverified", "{n:#}");
        let job = indexed(sj(51, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 2, 0), &[0, 1], &[]);
        fake.0.lock().unwrap().ctld.insert(51, job.clone());
        ing.tick(true).await;
        fake.0.lock().unwrap().ctld.insert(51, SlurmJob { state: "COMPLETED".into(), end_us: Some(t0 + 40 * S), ..job });
        ing.tick(true).await;
        let n = job_json(store.pool(), &admin, 51, 14).await.unwrap().unwrap()["nodes"][0].clone();
        assert_eq!((n["verified"].as_str(), n["gpu_seconds"].as_f64()), (Some("slurmctld"), Some(60.0)), "{n:#}");
        let fields: Vec<&str> = n["anomalies"].as_array().unwrap().iter().filter_map(|a| a["field"].as_str()).collect();
        assert_eq!(fields, vec!["gpus", "shards"], "the claims still disagree with Slurm: {n:#}");
    }

    /// A job's last step ends: the ingest passes after its step end ask Slurm, and the job is
    /// closed at slurmctld's EndTime on the first pass after Slurm says it ended, without a
    /// reconciliation tick (the gateway refuses the job's token from then on). A step end of a
    /// job that goes on leaves it open.
    async fn step_end_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let lab = |job: u32| JobIdentity { account: None, partition: None, ..ident(job, 1001, "gpuhublab") };
        write(spool.path(), &step(t0 + 10 * S, &lab(61), vec![g(0, None)], None));
        write(spool.path(), &step(t0 + 10 * S, &lab(62), vec![g(1, None)], None));
        let running = |id| indexed(sj(id, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[id - 61], &[]);
        let st = SlurmState {
            ctld_ok: true,
            acct_ok: true,
            ctld: BTreeMap::from([(61, running(61)), (62, running(62))]),
            ..SlurmState::default()
        };
        let (fake, mut ing) = watching(&store, spool.path(), st).await;
        ing.tick(true).await;
        let ended = || async { (store.job_ended(61, 1001).await.unwrap(), store.job_ended(62, 1001).await.unwrap()) };
        assert_eq!(ended().await, (false, false));
        // Both steps end; slurmctld still lists both running (61's end has not reached it yet).
        write(spool.path(), &step_end(t0 + 20 * S, &lab(61)));
        write(spool.path(), &step_end(t0 + 20 * S, &lab(62)));
        ing.tick(false).await;
        assert_eq!(ended().await, (false, false), "Slurm lists both running");
        fake.0.lock().unwrap().ctld.insert(61, SlurmJob { state: "COMPLETED".into(), end_us: Some(t0 + 21 * S), ..running(61) });
        ing.tick(false).await;
        assert_eq!(ended().await, (true, false), "the pass after Slurm said job 61 ended closes it, and only it");
        let admin = caller(0, "root", true);
        let n = job_json(store.pool(), &admin, 61, 14).await.unwrap().unwrap()["nodes"][0].clone();
        assert_eq!(
            (n["state"].as_str(), n["end_us"].as_i64(), n["gpu_seconds"].as_f64()),
            (Some("ended"), Some(t0 + 21 * S), Some(11.0)),
            "{n:#}"
        );
        assert!(kinds(&n).is_empty(), "an end from Slurm is no anomaly with job boundaries from Slurm: {n:#}");
        // 62 is still watched: the pass after Slurm says it ended closes it.
        fake.0.lock().unwrap().ctld.insert(62, SlurmJob { state: "CANCELLED".into(), end_us: Some(t0 + 22 * S), ..running(62) });
        ing.tick(false).await;
        assert_eq!(ended().await, (true, true));
        // A job with no step end is left to the reconciliation ticks.
        write(spool.path(), &step(t0 + 10 * S, &lab(63), vec![g(0, None)], None));
        fake.0.lock().unwrap().ctld.insert(63, running(63));
        ing.tick(false).await;
        fake.0.lock().unwrap().ctld.insert(63, SlurmJob { state: "COMPLETED".into(), end_us: Some(t0 + 23 * S), ..running(63) });
        ing.tick(false).await;
        assert!(!store.job_ended(63, 1001).await.unwrap(), "an ingest pass asked about a job none of whose steps ended");
        ing.tick(true).await;
        assert!(store.job_ended(63, 1001).await.unwrap());
    }

    /// A job whose step ended but that goes on is watched only until its next step starts, or
    /// until a look a while after the end still lists it running; its end then comes from a
    /// reconciliation tick.
    async fn step_end_watch_story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let t0 = (crate::util::now_us() / S - 1000) * S;
        store.set_setting("accounting.slurm_watch_since_us", &(t0 - S).to_string()).await.unwrap();
        let job = JobIdentity { account: None, partition: None, ..ident(71, 1001, "gpuhublab") };
        let step_at = |t: i64, step_id: u32, end: bool| {
            if end {
                Record::StepEnd { v: 1, time_us: t, job: job.clone(), step_id, exit_status: Some(0) }
            } else {
                Record::StepStart { v: 1, time_us: t, job: job.clone(), step_id, gpus: vec![g(0, None)], shards: None }
            }
        };
        write(spool.path(), &step_at(t0 + 10 * S, 0, false));
        let running = indexed(sj(71, Source::Slurmctld, "RUNNING", t0 + 10 * S, None, 1, 0), &[0], &[]);
        let st = SlurmState { ctld_ok: true, acct_ok: true, ctld: BTreeMap::from([(71, running.clone())]), ..SlurmState::default() };
        let (fake, ing) = watching(&store, spool.path(), st).await;
        let settled = std::time::Duration::from_millis(300);
        let mut ing = ing.with_step_end_settled(settled);
        ing.tick(true).await;
        fake.asked_about(71);
        write(spool.path(), &step_at(t0 + 20 * S, 0, true));
        ing.tick(false).await;
        assert!(fake.asked_about(71), "the pass that ingested step 0's end asks Slurm about job 71");
        write(spool.path(), &step_at(t0 + 21 * S, 1, false));
        ing.tick(false).await;
        ing.tick(false).await;
        assert!(!fake.asked_about(71), "step 1 started: the job goes on, and is not watched");
        write(spool.path(), &step_at(t0 + 30 * S, 1, true));
        ing.tick(false).await;
        assert!(fake.asked_about(71), "step 1's end: watched again");
        tokio::time::sleep(settled).await;
        ing.tick(false).await;
        assert!(fake.asked_about(71), "still watched until a look after the settling time");
        ing.tick(false).await;
        assert!(!fake.asked_about(71), "Slurm listed it running {settled:?} after its step's end: no longer watched");
        fake.0.lock().unwrap().ctld.insert(71, SlurmJob { state: "COMPLETED".into(), end_us: Some(t0 + 40 * S), ..running });
        ing.tick(false).await;
        assert!(!store.job_ended(71, 1001).await.unwrap(), "an unwatched job's end waits for a reconciliation");
        ing.tick(true).await;
        assert!(store.job_ended(71, 1001).await.unwrap(), "the reconciliation closes it");
    }

    #[tokio::test]
    async fn a_job_whose_last_step_ended_is_closed_once_slurm_says_so_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            step_end_story(store).await;
        }
    }

    #[tokio::test]
    async fn a_job_that_goes_on_after_a_step_is_watched_only_briefly_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            step_end_watch_story(store).await;
        }
    }

    #[tokio::test]
    async fn a_job_slurm_lists_late_is_verified_with_its_claims_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            late_listing_story(store).await;
        }
    }

    #[tokio::test]
    async fn a_requeued_job_is_billed_for_every_run_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            requeue_story(store).await;
        }
    }

    #[tokio::test]
    async fn reconcile_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            story(store).await;
        }
        for (store, _dir) in crate::store::testing::stores().await {
            slurm_story(store).await;
        }
    }

    #[test]
    fn a_run_requeued_to_another_node_at_once_is_verified_by_its_own_line_only() {
        let nodes: BTreeSet<String> = ["gpu01".to_string()].into();
        let now = 1_000_000 * S;
        let mut row = db::JobRow::new("gpu01", 9, 1001, "u", now - 14 * S);
        row.start_us = Some(now - 14 * S);
        let unverified = [row];
        let none = BTreeMap::new();
        let inp = Inputs {
            nodes: &nodes,
            default_node: "gpu01",
            unverified: &unverified,
            open: &[],
            known: &BTreeMap::new(),
            watch_since_us: 0,
            last_listed: &none,
            reconcile: false,
            grace_us: 5 * S,
            close_ended: false,
        };
        // Requeued: slurmctld lists it running on gpu02 since 2 s after this run began (within
        // TIME_TOLERANCE_US), and sacct --duplicates does not list this run yet.
        let mut st = SlurmState { taken_us: now, ctld_ok: true, acct_ok: true, ..SlurmState::default() };
        st.ctld.insert(9, SlurmJob { node_list: "gpu02".into(), ..sj(9, Source::Slurmctld, "RUNNING", now - 12 * S, None, 1, 0) });
        assert!(reconcile::plan(&inp, &st).is_empty(), "not verified from the later run on gpu02");
        // Its own line, once sacct lists it.
        st.ended_runs.insert(9, vec![sj(9, Source::Sacct, "REQUEUED", now - 14 * S, Some(now - 12 * S), 1, 0)]);
        let actions = reconcile::plan(&inp, &st);
        assert!(matches!(&actions[..], [Action::Verify { job_id: 9, job, .. }] if job.end_us == Some(now - 12 * S)), "{actions:?}");
        // Without slurmdbd (sacct does not answer) slurmctld's line is all there is.
        let no_acct = SlurmState { acct_ok: false, ended_runs: BTreeMap::new(), ..st };
        assert!(matches!(&reconcile::plan(&inp, &no_acct)[..], [Action::Verify { job_id: 9, .. }]));
    }

    #[test]
    fn plan_closes_nothing_it_cannot_know() {
        let nodes: BTreeSet<String> = ["gpu01".to_string()].into();
        let now = 1_000_000 * S;
        let mut open = db::JobRow::new("gpu01", 7, 1001, "u", now - 100 * S);
        open.start_us = Some(now - 100 * S);
        let fresh = db::JobRow { job_id: 8, start_us: Some(now - S), slurm_start_us: Some(now - S), ..open.clone() };
        let listed = BTreeMap::from([(7, now - 10 * S)]);
        let ran = |start_us| reconcile::LatestRun { start_us, ended: false };
        let known = BTreeMap::from([(7, ran(now - 100 * S)), (8, ran(now - S))]);
        let inp = Inputs {
            nodes: &nodes,
            default_node: "gpu01",
            unverified: &[],
            open: &[open.clone(), fresh],
            known: &known,
            watch_since_us: 0,
            last_listed: &listed,
            reconcile: true,
            grace_us: 5 * S,
            close_ended: false,
        };
        // slurmctld did not answer: nothing is closed.
        let down = SlurmState { taken_us: now, ctld_ok: false, ..SlurmState::default() };
        assert!(reconcile::plan(&inp, &down).is_empty());
        // It answered without job 7 and sacct has no row: closed at the last look that listed
        // it; job 8 started within the grace and may not be listed yet.
        let up = SlurmState { taken_us: now, ctld_ok: true, acct_ok: true, ..SlurmState::default() };
        let actions = reconcile::plan(&inp, &up);
        assert_eq!(actions.len(), 1, "{actions:?}");
        assert!(matches!(&actions[0], Action::Close { job_id: 7, end_us, .. } if *end_us == now - 10 * S), "{actions:?}");
        // Still running: nothing.
        let mut running = up.clone();
        running.ctld.insert(7, sj(7, Source::Slurmctld, "RUNNING", now - 100 * S, None, 1, 0));
        assert!(reconcile::plan(&inp, &running).is_empty());
        // Running elsewhere (not this node): closed.
        running.ctld.get_mut(&7).unwrap().node_list = "gpu02".into();
        assert_eq!(reconcile::plan(&inp, &running).len(), 1);
        // Listed on a line that was not used (a comment like "x Nodes=a" doubles a field): not
        // closed, whatever sacct says, and it counts as listed now.
        let mut unsure = up.clone();
        unsure.ctld_unsure.insert(7);
        assert!(reconcile::plan(&inp, &unsure).is_empty(), "a job slurmctld still lists is not closed");
        assert!(reconcile::listed_live(&unsure, &nodes).contains(&7));
        // ... unless sacct says it ended: closed at sacct's End.
        unsure.acct.insert(7, sj(7, Source::Sacct, "COMPLETED", now - 100 * S, Some(now - 3 * S), 1, 0));
        let actions = reconcile::plan(&inp, &unsure);
        assert!(matches!(&actions[..], [Action::Close { job_id: 7, end_us, exact: true, .. }] if *end_us == now - 3 * S), "{actions:?}");
        // Verifying job 7: slurmdbd's first record of a job (no partition, no TRES, uid 0: seen
        // on the lab) is not used; nor, while slurmctld lists the job on a line not used, is
        // sacct's record of it running; once it has ended, it is.
        let unverified = [open.clone()];
        let verify_only = Inputs { unverified: &unverified, reconcile: false, ..inp };
        let mut early = up.clone();
        let first = sj(7, Source::Sacct, "RUNNING", now - 100 * S, None, 0, 0);
        early.acct.insert(7, SlurmJob { partition: None, cpus: 0, uid: Some(0), ..first });
        assert!(reconcile::plan(&verify_only, &early).is_empty());
        let mut live = up.clone();
        live.ctld_unsure.insert(7);
        live.acct.insert(7, sj(7, Source::Sacct, "RUNNING", now - 100 * S, None, 1, 0));
        assert!(reconcile::plan(&verify_only, &live).is_empty());
        live.acct.get_mut(&7).unwrap().state = "COMPLETED".into();
        let actions = reconcile::plan(&verify_only, &live);
        assert!(matches!(&actions[..], [Action::Verify { job_id: 7, .. }]), "{actions:?}");

        // Job ends from Slurm: a job Slurm says has ended is closed at once, within the grace
        // (job 8 started 1 s ago) and on an ingest pass too; a job without Slurm's word is not.
        let mut said = up.clone();
        said.ctld.insert(7, sj(7, Source::Slurmctld, "RUNNING", now - 100 * S, None, 1, 0));
        said.ctld.insert(8, sj(8, Source::Slurmctld, "COMPLETED", now - S, Some(now - S / 2), 1, 0));
        assert!(reconcile::plan(&inp, &said).is_empty(), "without close_ended, job 8 waits for the grace");
        let ends = Inputs { close_ended: true, ..inp };
        let pass = Inputs { reconcile: false, ..ends };
        for (what, inp) in [("a reconciliation", &ends), ("an ingest pass", &pass)] {
            let actions = reconcile::plan(inp, &said);
            assert!(
                matches!(&actions[..], [Action::Close { job_id: 8, end_us, exact: true, .. }] if *end_us == now - S / 2),
                "{what}: {actions:?}"
            );
        }
        // Not verified yet: closed at once when slurmctld's record, from a look taken after the
        // run's first record, started no later than it (slurmctld lists a job's latest run);
        // else the grace: a look older than the run (slurmctld still describing an earlier
        // run of a requeued job), or a record that started later (a later run).
        let unpinned = [db::JobRow { slurm_start_us: None, ..inp.open[1].clone() }];
        let actions = reconcile::plan(&Inputs { open: &unpinned, ..pass }, &said);
        assert!(matches!(&actions[..], [Action::Close { job_id: 8, exact: true, job: Some(_), .. }]), "{actions:?}");
        let stale = SlurmState { taken_us: now - 2 * S, ..said.clone() };
        assert!(reconcile::plan(&Inputs { open: &unpinned, ..ends }, &stale).is_empty(), "a look older than the run");
        let mut later = said.clone();
        later.ctld.insert(8, sj(8, Source::Slurmctld, "COMPLETED", now - S / 2, Some(now - S / 4), 1, 0));
        let late_start = [db::JobRow { start_us: Some(now - 3 * S), ..unpinned[0].clone() }];
        assert!(reconcile::plan(&Inputs { open: &late_start, ..ends }, &later).is_empty(), "Slurm's record of a later run");
        // A job a look older than its first record does not list is not unverified: the look
        // could not know it.
        let before_it = SlurmState { taken_us: now - 2 * S, ..up.clone() };
        let verify_new = Inputs { unverified: &unpinned, open: &[], reconcile: false, ..inp };
        assert!(reconcile::plan(&verify_new, &before_it).is_empty(), "a look taken before the job");
        assert!(matches!(&reconcile::plan(&verify_new, &up)[..], [Action::Unverified { job_id: 8, .. }]));
        // An ingest pass closes nothing Slurm has not said ended (job 7 is gone from slurmctld,
        // sacct has no row: only a reconciliation closes it, at its last listing).
        assert!(reconcile::plan(&pass, &up).is_empty());
        assert!(matches!(&reconcile::plan(&ends, &up)[..], [Action::Close { job_id: 7, exact: false, .. }]));
    }

    #[test]
    fn a_job_that_started_in_the_second_watching_began_is_created() {
        let nodes: BTreeSet<String> = ["gpu01".to_string()].into();
        let now = 1_000_000 * S;
        let known = BTreeMap::new();
        let listed = BTreeMap::new();
        let inp = Inputs {
            nodes: &nodes,
            default_node: "gpu01",
            unverified: &[],
            open: &[],
            known: &known,
            // The agent began watching 330 ms into a second ...
            watch_since_us: now - 20 * S + 330_000,
            last_listed: &listed,
            reconcile: true,
            grace_us: 5 * S,
            close_ended: false,
        };
        let mut st = SlurmState { taken_us: now, ctld_ok: true, acct_ok: true, ..SlurmState::default() };
        // ... job 9 started 110 ms later, and Slurm's StartTime is that whole second; job 10
        // started the second before, when nobody watched.
        st.ctld.insert(9, sj(9, Source::Slurmctld, "COMPLETED", now - 20 * S, Some(now - 10 * S), 0, 2));
        st.ctld.insert(10, sj(10, Source::Slurmctld, "COMPLETED", now - 21 * S, Some(now - 10 * S), 0, 2));
        let created: Vec<u32> = reconcile::plan(&inp, &st)
            .iter()
            .filter_map(|a| match a {
                Action::Create { job, .. } => Some(job.job_id),
                _ => None,
            })
            .collect();
        assert_eq!(created, [9]);
    }
}

// ---- GPU-hours counters from the store (usage_counters.rs), on every backend.

mod usage_counter_story {
    use super::*;
    use crate::accounting::usage_counters::UsageCounters;

    fn counters(registry: &Registry) -> BTreeMap<String, f64> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.lines()
            .filter(|l| {
                l.starts_with("gpuhub_slurm_gpu_seconds_total{")
                    || l.starts_with("gpuhub_slurm_shard_seconds_total{")
                    || l.starts_with("gpuhub_store_up ")
            })
            .filter_map(|l| l.rsplit_once(' ').map(|(k, v)| (k.to_string(), v.parse().unwrap())))
            .collect()
    }

    fn key(kind: &str, user: &str) -> String {
        format!("gpuhub_slurm_{kind}_seconds_total{{user=\"{user}\",account=\"{user}-lab\"}}")
    }

    async fn story(store: Store) {
        let spool = tempfile::tempdir().unwrap();
        let now = crate::util::now_us();
        let old = now - 5 * 24 * 3600 * S; // settled: ended before the 2-day window
        let (alice, bob, carol) = (ident(31, 1001, "alice"), ident(32, 1002, "bob"), ident(33, 1003, "carol"));
        let mut elsewhere = ident(34, 1001, "alice");
        elsewhere.node = "gpu02".into();
        // alice: gpu:2 for 100 s five days ago, and gpu:1 running for the last 60 s.
        write(spool.path(), &start(old, &alice, vec![g(0, Some(U0)), g(1, Some(U1))]));
        write(spool.path(), &end(old + 100 * S, &alice, vec![g(0, Some(U0)), g(1, Some(U1))]));
        let mut alice2 = ident(35, 1001, "alice");
        alice2.job_id = 35;
        write(spool.path(), &start(now - 60 * S, &alice2, vec![g(0, Some(U0))]));
        // bob: shard:7 for 30 s an hour ago; carol: CPU only.
        write(spool.path(), &start(now - 3600 * S, &bob, vec![g(1, None)]));
        write(spool.path(), &step(now - 3599 * S, &bob, vec![g(1, None)], Some(7)));
        write(spool.path(), &end(now - 3570 * S, &bob, vec![g(1, None)]));
        write(spool.path(), &start(now - 100 * S, &carol, vec![]));
        write(spool.path(), &end(now - 50 * S, &carol, vec![]));
        // Another node's job in a shared store: not this agent's to export.
        write(spool.path(), &start(now - 100 * S, &elsewhere, vec![g(0, None)]));
        write(spool.path(), &end(now - 10 * S, &elsewhere, vec![g(0, None)]));
        let mut registry = Registry::default();
        let metrics = AccountingMetrics::register(registry.sub_registry_with_prefix("gpuhub"));
        let usage = metrics.usage.clone();
        let mut ing = Ingestor::new(store.clone(), spool.path(), Arc::new(FakeGpus), metrics);
        assert_eq!(ing.pass().await.ingested, 10);

        let mut uc = UsageCounters::new(store.clone(), "gpu01", usage);
        uc.load().await;
        uc.pass().await;
        let c = counters(&registry);
        assert_eq!(c["gpuhub_store_up"], 1.0, "{c:?}");
        let alice_gpu = c[&key("gpu", "alice")];
        assert!((259.0..270.0).contains(&alice_gpu), "200 s settled + 60 s running (+ the test's own time): {c:?}");
        assert_eq!(c[&key("shard", "bob")], 7.0 * 30.0, "{c:?}");
        assert_eq!(c[&key("gpu", "bob")], 0.0);
        assert_eq!(c[&key("gpu", "carol")], 0.0, "CPU jobs bill no GPU time");
        // The same figures as `gpuhub usage` (all time, this node's jobs only).
        let v = usage_json(store.pool(), &caller(0, "root", true), "30d", 30 * 24 * 3600, UsageBy::User, 14).await.unwrap();
        let table_alice = row(&v, "alice")["gpu_seconds"].as_f64().unwrap();
        assert!((table_alice - 90.0 - alice_gpu).abs() < 3.0, "usage adds gpu02's 90 s: table {table_alice}, counter {alice_gpu}");
        assert_eq!(row(&v, "bob")["shard_seconds"].as_f64().unwrap(), c[&key("shard", "bob")]);

        // The running job keeps counting.
        tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
        uc.pass().await;
        assert!(counters(&registry)[&key("gpu", "alice")] > alice_gpu, "a running job's time grows");

        // The store corrects itself downwards (bob's end was 10 s earlier): the counter holds.
        sqlx::query("UPDATE acct_jobs SET end_us = end_us - $1 WHERE job_id = 32").bind(10 * S).execute(store.pool()).await.unwrap();
        uc.pass().await;
        assert_eq!(counters(&registry)[&key("shard", "bob")], 210.0, "monotone: no drop Prometheus would read as a reset");

        // A restart: a fresh registry starts where the last one stopped, before and after its
        // first pass.
        let before = counters(&registry);
        let mut registry2 = Registry::default();
        let m2 = AccountingMetrics::register(registry2.sub_registry_with_prefix("gpuhub"));
        let mut uc2 = UsageCounters::new(store.clone(), "gpu01", m2.usage.clone());
        uc2.load().await;
        let loaded = counters(&registry2);
        assert_eq!(loaded[&key("shard", "bob")], 210.0, "{loaded:?}");
        assert!(loaded[&key("gpu", "alice")] >= before[&key("gpu", "alice")] - 1e-6, "{loaded:?} vs {before:?}");
        uc2.pass().await;
        let after = counters(&registry2);
        for (k, v) in &before {
            if k.starts_with("gpuhub_slurm_") {
                assert!(after[k] >= *v, "{k}: {v} -> {}", after[k]);
            }
        }

        // The store goes away: store_up 0, counters hold.
        store.close().await;
        uc2.pass().await;
        let down = counters(&registry2);
        assert_eq!(down["gpuhub_store_up"], 0.0);
        assert_eq!(down[&key("shard", "bob")], 210.0);
    }

    #[tokio::test]
    async fn usage_counters_on_every_backend() {
        for (store, _dir) in crate::store::testing::stores().await {
            story(store).await;
        }
    }
}

#[test]
fn running_jobs_carry_the_last_sample_per_gpu() {
    let body = || {
        json!({"job_id": 11, "nodes": [
            {"node": "gpu01", "state": "running", "gpus": [{"index": 0}, {"index": 1}]},
            {"node": "gpu02", "state": "running", "gpus": [{"index": 0}]},
        ]})
    };
    let mut v = body();
    add_live(&mut v, &FakeGpus, "gpu01", 30);
    let n = &v["nodes"][0];
    assert_eq!(n["gpus"][0]["current"], json!({"util": 77.0, "vram_bytes": 3u64 << 30, "at": 0}), "{v:#}");
    assert!(n["gpus"][1]["current"].is_null(), "no sample of the job on GPU 1: {v:#}");
    assert!(v["nodes"][1]["gpus"][0].get("current").is_none(), "another node's GPU 0 is not this node's: {v:#}");
    // A sample older than LIVE_MAX_AGE_S is not current.
    let mut old = body();
    add_live(&mut old, &FakeGpus, "gpu01", LIVE_MAX_AGE_S + 1);
    assert!(old["nodes"][0]["gpus"][0]["current"].is_null(), "{old:#}");
    // An ended job keeps its means and peaks only.
    let mut ended = body();
    ended["nodes"][0]["state"] = json!("ended");
    add_live(&mut ended, &FakeGpus, "gpu01", 30);
    assert!(ended["nodes"][0]["gpus"][0].get("current").is_none(), "{ended:#}");
    // Another job: no samples.
    let mut other = body();
    other["job_id"] = json!(12);
    add_live(&mut other, &FakeGpus, "gpu01", 30);
    assert!(other["nodes"][0]["gpus"][0]["current"].is_null(), "{other:#}");
}
