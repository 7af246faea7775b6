//! The weights of MLflow model versions: a version's artifacts, downloaded once into a
//! bounded, content-addressed cache, and the directory (`{model_path}`) and single weights
//! file (`{model_file}`) a worker starts on.
//!
//! Sources (the version's `get-download-uri`):
//! - `mlflow-artifacts:` (a tracking server that serves artifacts): listed and downloaded
//!   through the artifact REST API of `mlflow.tracking_uri` (`/api/2.0/mlflow-artifacts/
//!   artifacts`), never from a host named in the URI: the registry is writable by anyone on
//!   the node, and the agent must not fetch what a stranger points it at;
//! - `file:` (and a bare absolute path): copied from under one of `mlflow.file_roots` only,
//!   symlinks refused, since the agent reads as root.
//!
//! Layout of `mlflow.cache_dir` (root-owned, 0711):
//! - `sha256-<digest>/`: one complete version, named by the digest of its files (relative
//!   path, size and SHA-256 of each), `root:<worker group>` 0750, files 0640. Two versions
//!   with the same files share one directory.
//! - `partial/<random>/`: a download under way. It gets its final name by `rename` only
//!   after every file arrived whole (the size MLflow listed, the bytes hashed), so a partial
//!   download is never served; leftovers of a crash are removed at start.
//! - `index/<sha256 of the model name>.<version>`: the digest a version resolved to, so a
//!   restart does not download again.
//!
//! The cache holds at most `mlflow.cache_max_gib`: before a download, the least recently used
//! versions that no worker runs on are removed until the new one fits.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};

use super::mlflow::{Mlflow, MlflowError};

/// File endings of model weights (`{model_file}` is the one such file of a version).
const WEIGHT_ENDINGS: [&str; 7] = [".gguf", ".safetensors", ".bin", ".pt", ".pth", ".onnx", ".ggml"];
/// A version with more files than this is not a model (or is a mistake).
const MAX_FILES: usize = 10_000;
const MAX_DEPTH: usize = 16;
/// Longest wait for one chunk of a download.
const CHUNK_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error(transparent)]
    Mlflow(#[from] MlflowError),
    #[error("version `{0}` is not an MLflow model version number")]
    BadVersion(String),
    #[error(
        "the artifacts of `{model}` version {version} are at `{uri}`, which gpuhub cannot fetch; log the model to the tracking server with artifact serving (`mlflow server` serves `mlflow-artifacts:` by default), or keep it under a directory of mlflow.file_roots"
    )]
    Unsupported { model: String, version: String, uri: String },
    #[error(
        "the artifacts of `{model}` version {version} are at `{path}`, outside mlflow.file_roots ({roots}); add its directory to mlflow.file_roots if it is meant to be served"
    )]
    OutsideRoots { model: String, version: String, path: String, roots: String },
    #[error("the artifacts of `{model}` version {version} hold `{path}`: {problem}")]
    BadEntry { model: String, version: String, path: String, problem: String },
    #[error("`{model}` version {version} has no artifact files at `{uri}`; log the weights with the model version")]
    Empty { model: String, version: String, uri: String },
    #[error(
        "`{model}` version {version} needs {need_gib:.2} GiB of artifacts and the cache may hold {max_gib:.2} GiB (mlflow.cache_max_gib); raise it"
    )]
    TooBig { model: String, version: String, need_gib: f64, max_gib: f64 },
    #[error(
        "`{model}` version {version} needs {need_gib:.2} GiB in the artifact cache and only {free_gib:.2} GiB of mlflow.cache_max_gib are free: the rest holds versions running workers use; retry when one unloads, or raise mlflow.cache_max_gib"
    )]
    NoRoom { model: String, version: String, need_gib: f64, free_gib: f64 },
    #[error("downloading `{path}` of `{model}` version {version} failed: {problem} (nothing of it is served; the next start retries)")]
    Download { model: String, version: String, path: String, problem: String },
    #[error("artifact cache {path}: {source} (check mlflow.cache_dir)")]
    Io { path: String, source: std::io::Error },
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ArtifactError + '_ {
    move |source| ArtifactError::Io { path: path.display().to_string(), source }
}

/// Where a version's artifacts are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A path under the tracking server's artifact root (`mlflow-artifacts:/PATH`).
    Served(String),
    /// A local directory or file (`file:///PATH`, `/PATH`).
    Local(PathBuf),
}

impl Source {
    /// Parses a download URI; `None` for schemes gpuhub does not fetch (s3:, gs:, http:, ...).
    pub fn parse(uri: &str) -> Option<Source> {
        if let Some(rest) = uri.strip_prefix("mlflow-artifacts:") {
            // `mlflow-artifacts://host:port/PATH` or `mlflow-artifacts:/PATH`: the host is
            // ignored (see the module doc); the path is what the tracking server serves.
            let path = match rest.strip_prefix("//") {
                Some(auth_and_path) => auth_and_path.split_once('/').map(|(_, p)| p).unwrap_or(""),
                None => rest,
            };
            let path = path.trim_matches('/');
            return Some(Source::Served(path.to_string()));
        }
        if let Some(rest) = uri.strip_prefix("file://") {
            // file:///abs (empty authority) or file://localhost/abs.
            let path = rest.strip_prefix("localhost").unwrap_or(rest);
            return path.starts_with('/').then(|| Source::Local(PathBuf::from(percent_decode(path))));
        }
        if let Some(rest) = uri.strip_prefix("file:") {
            return rest.starts_with('/').then(|| Source::Local(PathBuf::from(percent_decode(rest))));
        }
        if uri.starts_with('/') {
            return Some(Source::Local(PathBuf::from(uri)));
        }
        None
    }
}

/// `%20` and friends in a `file:` URI.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let Some(v) = std::str::from_utf8(&b[i + 1..i + 3]).ok().and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// One file of a version: its path relative to the version's root, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Listed {
    rel: String,
    size: u64,
}

/// A version's weights in the cache, ready to start on. Holding it keeps the directory from
/// being evicted.
#[derive(Debug)]
pub struct Weights {
    /// `{model_path}`: the version's directory.
    pub dir: PathBuf,
    /// `{model_file}`: its single weights file, if it has exactly one.
    pub model_file: Option<PathBuf>,
    /// The weights files found (for the message when `{model_file}` is asked and not one).
    pub weight_files: Vec<String>,
    pub digest: String,
    _pin: Pin,
}

#[derive(Debug)]
struct Pin {
    pins: Arc<Mutex<BTreeMap<String, usize>>>,
    digest: String,
}

impl Drop for Pin {
    fn drop(&mut self) {
        let mut p = self.pins.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = p.get_mut(&self.digest) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.digest);
            }
        }
    }
}

/// The artifact cache (`mlflow.cache_dir`).
#[derive(Debug)]
pub struct ArtifactCache {
    dir: PathBuf,
    max_bytes: u64,
    file_roots: Vec<PathBuf>,
    /// The worker account's group: version directories are `root:<gid>` 0750.
    gid: Option<u32>,
    http: reqwest::Client,
    /// One download at a time (hits do not wait).
    fetching: tokio::sync::Mutex<()>,
    /// Digests running workers use, with their counts.
    pins: Arc<Mutex<BTreeMap<String, usize>>>,
}

impl ArtifactCache {
    /// Opens the cache (its directories are made at the first download) and removes
    /// downloads a crash left half done.
    pub fn open(dir: PathBuf, max_gib: f64, file_roots: Vec<PathBuf>, gid: Option<u32>) -> Result<ArtifactCache, ArtifactError> {
        let partial = dir.join("partial");
        if partial.exists() {
            std::fs::remove_dir_all(&partial).map_err(io(&partial))?;
        }
        let http = reqwest::Client::builder().connect_timeout(Duration::from_secs(5)).pool_max_idle_per_host(0).build().unwrap_or_default();
        Ok(ArtifactCache {
            dir,
            max_bytes: (max_gib * GIB) as u64,
            file_roots,
            gid,
            http,
            fetching: tokio::sync::Mutex::new(()),
            pins: Arc::new(Mutex::new(BTreeMap::new())),
        })
    }

    /// The weights of `name` version `version`: from the cache, or downloaded into it.
    pub async fn fetch(&self, mlflow: &Mlflow, name: &str, version: &str) -> Result<Weights, ArtifactError> {
        if version.is_empty() || version.len() > 12 || !version.bytes().all(|b| b.is_ascii_digit()) {
            return Err(ArtifactError::BadVersion(crate::util::sanitize(version)));
        }
        if let Some(w) = self.cached(name, version) {
            return Ok(w);
        }
        let _one = self.fetching.lock().await;
        if let Some(w) = self.cached(name, version) {
            return Ok(w);
        }
        let uri = mlflow.download_uri(name, version).await?;
        let (model, ver) = (crate::util::sanitize(name), version.to_string());
        let source = Source::parse(&uri).ok_or_else(|| ArtifactError::Unsupported {
            model: model.clone(),
            version: ver.clone(),
            uri: crate::util::sanitize(&uri),
        })?;
        let files = match &source {
            Source::Served(path) => self.list_served(mlflow, path, &model, &ver).await?,
            Source::Local(path) => {
                let root = self.local_root(path, &model, &ver)?;
                let (model, ver) = (model.clone(), ver.clone());
                tokio::task::spawn_blocking(move || list_local(&root, &model, &ver))
                    .await
                    .map_err(|e| ArtifactError::Io { path: path.display().to_string(), source: std::io::Error::other(e) })??
            }
        };
        if files.is_empty() {
            return Err(ArtifactError::Empty { model, version: ver, uri: crate::util::sanitize(&uri) });
        }
        let need: u64 = files.iter().map(|f| f.size).sum();
        self.ensure_dirs()?;
        self.make_room(need, &model, &ver)?;
        let partial = self.dir.join("partial").join(hex::encode(rand::random::<[u8; 8]>()));
        std::fs::create_dir_all(&partial).map_err(io(&partial))?;
        let result = self.download(mlflow, &source, &files, &partial, &model, &ver).await;
        let digest = match result {
            Ok(d) => d,
            Err(e) => {
                let _ = std::fs::remove_dir_all(partial);
                return Err(e);
            }
        };
        let final_dir = self.dir.join(format!("sha256-{digest}"));
        if final_dir.exists() {
            let _ = std::fs::remove_dir_all(partial);
        } else {
            self.seal(&partial)?;
            std::fs::rename(partial, &final_dir).map_err(io(&final_dir))?;
        }
        self.write_index(name, version, &digest)?;
        tracing::info!(model = %model, version = %ver, digest = %digest, bytes = need, files = files.len(), "downloaded a model version's artifacts");
        self.cached(name, version).ok_or_else(|| ArtifactError::Io {
            path: final_dir.display().to_string(),
            source: std::io::Error::other("the version's directory vanished right after it was written"),
        })
    }

    /// The cache's directories: the root and index 0711 (workers open their version's
    /// directory by name, nobody lists the cache), partial downloads 0700.
    fn ensure_dirs(&self) -> Result<(), ArtifactError> {
        for (d, mode) in [(self.dir.clone(), 0o711), (self.dir.join("index"), 0o711), (self.dir.join("partial"), 0o700)] {
            std::fs::create_dir_all(&d).map_err(io(&d))?;
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(mode)).map_err(io(&d))?;
        }
        Ok(())
    }

    fn index_path(&self, name: &str, version: &str) -> PathBuf {
        self.dir.join("index").join(format!("{}.{version}", hex::encode(Sha256::digest(name.as_bytes()))))
    }

    fn write_index(&self, name: &str, version: &str, digest: &str) -> Result<(), ArtifactError> {
        let path = self.index_path(name, version);
        let tmp = path.with_extension(format!("{version}.tmp"));
        std::fs::write(&tmp, digest).map_err(io(&tmp))?;
        std::fs::rename(tmp, &path).map_err(io(&path))
    }

    /// The version's complete directory, when the index knows it and it is still there.
    fn cached(&self, name: &str, version: &str) -> Option<Weights> {
        let digest = std::fs::read_to_string(self.index_path(name, version)).ok()?;
        let digest = digest.trim();
        if digest.len() != 64 || !digest.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let dir = self.dir.join(format!("sha256-{digest}"));
        if !dir.is_dir() {
            return None;
        }
        // Recently used: eviction goes by the directory's mtime.
        if let Ok(f) = std::fs::File::open(&dir) {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        let mut weight_files = Vec::new();
        walk_files(&dir, &dir, 0, &mut |rel, _| {
            if is_weights(rel) {
                weight_files.push(rel.to_string());
            }
        })
        .ok()?;
        weight_files.sort();
        let model_file = (weight_files.len() == 1).then(|| dir.join(&weight_files[0]));
        {
            let mut p = self.pins.lock().unwrap_or_else(|e| e.into_inner());
            *p.entry(digest.to_string()).or_insert(0) += 1;
        }
        Some(Weights {
            dir,
            model_file,
            weight_files,
            digest: digest.to_string(),
            _pin: Pin { pins: self.pins.clone(), digest: digest.to_string() },
        })
    }

    /// Removes the least recently used versions no worker uses until `need` bytes fit.
    fn make_room(&self, need: u64, model: &str, version: &str) -> Result<(), ArtifactError> {
        let gib = |b: u64| b as f64 / GIB;
        if need > self.max_bytes {
            return Err(ArtifactError::TooBig {
                model: model.into(),
                version: version.into(),
                need_gib: gib(need),
                max_gib: gib(self.max_bytes),
            });
        }
        let mut entries = self.entries()?;
        let mut used: u64 = entries.iter().map(|e| e.2).sum();
        entries.sort_by_key(|e| e.1);
        let pinned: Vec<String> = self.pins.lock().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect();
        for (digest, _, size) in entries {
            if used + need <= self.max_bytes {
                break;
            }
            if pinned.contains(&digest) {
                continue;
            }
            let dir = self.dir.join(format!("sha256-{digest}"));
            tracing::info!(digest = %digest, bytes = size, "artifact cache: removing the least recently used version to make room");
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
            used = used.saturating_sub(size);
        }
        if used + need > self.max_bytes {
            return Err(ArtifactError::NoRoom {
                model: model.into(),
                version: version.into(),
                need_gib: gib(need),
                free_gib: gib(self.max_bytes.saturating_sub(used)),
            });
        }
        Ok(())
    }

    /// Complete versions: digest, last use, bytes.
    fn entries(&self) -> Result<Vec<(String, std::time::SystemTime, u64)>, ArtifactError> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).map_err(io(&self.dir))?.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(digest) = name.strip_prefix("sha256-") else { continue };
            let path = e.path();
            let when = e.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH);
            let mut size = 0u64;
            walk_files(&path, &path, 0, &mut |_, n| size += n).map_err(io(&path))?;
            out.push((digest.to_string(), when, size));
        }
        Ok(out)
    }

    /// A local source's root, checked against `mlflow.file_roots` after resolving symlinks.
    fn local_root(&self, path: &Path, model: &str, version: &str) -> Result<PathBuf, ArtifactError> {
        let roots = || self.file_roots.iter().map(|r| r.display().to_string()).collect::<Vec<_>>().join(", ");
        let outside = || ArtifactError::OutsideRoots {
            model: model.into(),
            version: version.into(),
            path: crate::util::sanitize(&path.display().to_string()),
            roots: if self.file_roots.is_empty() { "none set".into() } else { roots() },
        };
        let real = std::fs::canonicalize(path).map_err(|_| outside())?;
        let inside = self.file_roots.iter().filter_map(|r| std::fs::canonicalize(r).ok()).any(|r| real.starts_with(&r));
        if !inside {
            return Err(outside());
        }
        Ok(real)
    }

    /// Lists a served path recursively (the API lists one level, by base name).
    async fn list_served(&self, mlflow: &Mlflow, root: &str, model: &str, version: &str) -> Result<Vec<Listed>, ArtifactError> {
        let mut out = Vec::new();
        let mut dirs = vec![(String::new(), 0usize)];
        while let Some((rel, depth)) = dirs.pop() {
            let path = if rel.is_empty() { root.to_string() } else { format!("{root}/{rel}") };
            let url = format!("{}/api/2.0/mlflow-artifacts/artifacts", mlflow.tracking_uri());
            let fail = |problem: String| ArtifactError::Download {
                model: model.into(),
                version: version.into(),
                path: crate::util::sanitize(&path),
                problem,
            };
            let resp = self
                .http
                .get(&url)
                .query(&[("path", path.as_str())])
                .timeout(Duration::from_secs(30))
                .send()
                .await
                .map_err(|e| fail(format!("cannot list it at {url}: {e}")))?;
            let status = resp.status();
            let body: serde_json::Value = resp.json().await.unwrap_or(serde_json::Value::Null);
            if !status.is_success() {
                return Err(fail(format!(
                    "listing answered {status}: {} (does the tracking server serve artifacts?)",
                    crate::util::sanitize(body["message"].as_str().unwrap_or(""))
                )));
            }
            for f in body["files"].as_array().into_iter().flatten() {
                let base = f["path"].as_str().unwrap_or("");
                let base = base.rsplit('/').next().unwrap_or(base);
                check_name(base).map_err(|problem| ArtifactError::BadEntry {
                    model: model.into(),
                    version: version.into(),
                    path: crate::util::sanitize(base),
                    problem,
                })?;
                let child = if rel.is_empty() { base.to_string() } else { format!("{rel}/{base}") };
                if f["is_dir"].as_bool() == Some(true) {
                    if depth + 1 >= MAX_DEPTH {
                        return Err(fail(format!("directories nest deeper than {MAX_DEPTH}")));
                    }
                    dirs.push((child, depth + 1));
                } else {
                    // int64 fields come as JSON numbers or strings.
                    let size = f["file_size"].as_u64().or_else(|| f["file_size"].as_str().and_then(|s| s.parse().ok())).unwrap_or(0);
                    out.push(Listed { rel: child, size });
                }
                if out.len() > MAX_FILES {
                    return Err(fail(format!("more than {MAX_FILES} files")));
                }
            }
        }
        // A single file as the source: the listing of a file is empty; take the file itself.
        if out.is_empty() && !root.is_empty() && !root.ends_with('/') {
            let base = root.rsplit('/').next().unwrap_or(root);
            if is_weights(base) {
                out.push(Listed { rel: base.to_string(), size: 0 });
            }
        }
        out.sort_by(|a, b| a.rel.cmp(&b.rel));
        Ok(out)
    }

    /// Fetches every file into `into`, checks sizes, and returns the version's digest.
    async fn download(
        &self,
        mlflow: &Mlflow,
        source: &Source,
        files: &[Listed],
        into: &Path,
        model: &str,
        version: &str,
    ) -> Result<String, ArtifactError> {
        let mut manifest = String::new();
        for f in files {
            let dest = into.join(&f.rel);
            if let Some(parent) = dest.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            let fail = |problem: String| ArtifactError::Download {
                model: model.into(),
                version: version.into(),
                path: crate::util::sanitize(&f.rel),
                problem,
            };
            let (hash, size) = match source {
                Source::Served(root) => {
                    // A single-file source: the file is the root itself.
                    let remote = if root.rsplit('/').next() == Some(f.rel.as_str()) && files.len() == 1 && f.size == 0 {
                        root.clone()
                    } else {
                        format!("{root}/{}", f.rel)
                    };
                    self.get_file(mlflow, &remote, &dest).await.map_err(fail)?
                }
                Source::Local(root) => {
                    let from = if root.is_file() { root.clone() } else { root.join(&f.rel) };
                    let dest = dest.clone();
                    tokio::task::spawn_blocking(move || copy_hashed(&from, &dest))
                        .await
                        .map_err(|e| fail(e.to_string()))?
                        .map_err(|e| fail(e.to_string()))?
                }
            };
            if f.size != 0 && size != f.size {
                return Err(fail(format!("got {size} bytes, MLflow listed {}", f.size)));
            }
            manifest.push_str(&format!("{}\0{size}\0{hash}\n", f.rel));
        }
        Ok(hex::encode(Sha256::digest(manifest.as_bytes())))
    }

    /// Streams one served file to `dest`, hashing it; (sha256, bytes).
    async fn get_file(&self, mlflow: &Mlflow, remote: &str, dest: &Path) -> Result<(String, u64), String> {
        let mut url =
            reqwest::Url::parse(&format!("{}/api/2.0/mlflow-artifacts/artifacts/", mlflow.tracking_uri())).map_err(|e| e.to_string())?;
        {
            let mut segs = url.path_segments_mut().map_err(|()| "the tracking URI cannot carry a path".to_string())?;
            segs.pop_if_empty();
            segs.extend(remote.split('/').filter(|s| !s.is_empty()));
        }
        let mut resp = self.http.get(url.clone()).send().await.map_err(|e| format!("GET {url}: {e}"))?;
        if !resp.status().is_success() {
            return Err(format!("GET {url} answered {}", resp.status()));
        }
        let mut file = std::fs::File::create(dest).map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
        let mut hasher = Sha256::new();
        let mut size = 0u64;
        loop {
            let chunk = tokio::time::timeout(CHUNK_TIMEOUT, resp.chunk())
                .await
                .map_err(|_| format!("no data for {}s", CHUNK_TIMEOUT.as_secs()))?
                .map_err(|e| format!("the download broke off after {size} bytes: {e}"))?;
            let Some(chunk) = chunk else { break };
            hasher.update(&chunk);
            size += chunk.len() as u64;
            file.write_all(&chunk).map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
        }
        file.sync_all().map_err(|e| format!("cannot write {}: {e}", dest.display()))?;
        Ok((hex::encode(hasher.finalize()), size))
    }

    /// Modes and group for workers: directories 0750, files 0640, group = the worker account's.
    fn seal(&self, dir: &Path) -> Result<(), ArtifactError> {
        let mut paths = vec![dir.to_path_buf()];
        walk_all(dir, 0, &mut paths).map_err(io(dir))?;
        for p in paths {
            let is_dir = p.is_dir();
            let (mode, open) = if is_dir { (0o750, 0o755) } else { (0o640, 0o644) };
            match self.gid {
                Some(gid) => {
                    std::os::unix::fs::chown(&p, None, Some(gid)).map_err(io(&p))?;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).map_err(io(&p))?;
                }
                // No worker account known (an unprivileged agent): readable by the agent's
                // own workers, which run as the agent.
                None => std::fs::set_permissions(&p, std::fs::Permissions::from_mode(open)).map_err(io(&p))?,
            }
        }
        Ok(())
    }
}

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Whether a file name is a weights file (`{model_file}`).
pub fn is_weights(rel: &str) -> bool {
    let lower = rel.to_ascii_lowercase();
    WEIGHT_ENDINGS.iter().any(|e| lower.ends_with(e))
}

/// A name MLflow listed must be one plain path component.
fn check_name(base: &str) -> Result<(), String> {
    if base.is_empty() || base == "." || base == ".." || base.contains('/') || base.contains('\0') || base.contains('\\') {
        return Err("not a plain file name".into());
    }
    if base.len() > 255 {
        return Err("a file name longer than 255 bytes".into());
    }
    Ok(())
}

/// Files under a local root (or the root itself when it is a file); symlinks refused.
fn list_local(root: &Path, model: &str, version: &str) -> Result<Vec<Listed>, ArtifactError> {
    let meta = std::fs::symlink_metadata(root).map_err(io(root))?;
    if meta.is_file() {
        let base = root.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        return Ok(vec![Listed { rel: base, size: meta.len() }]);
    }
    let mut out = Vec::new();
    let mut bad: Option<String> = None;
    walk_local(root, root, 0, &mut out, &mut bad).map_err(io(root))?;
    if let Some(path) = bad {
        return Err(ArtifactError::BadEntry {
            model: model.into(),
            version: version.into(),
            path: crate::util::sanitize(&path),
            problem: "a symlink or special file (only plain files and directories are copied)".into(),
        });
    }
    if out.len() > MAX_FILES {
        return Err(ArtifactError::BadEntry {
            model: model.into(),
            version: version.into(),
            path: root.display().to_string(),
            problem: format!("more than {MAX_FILES} files"),
        });
    }
    out.sort_by(|a, b| a.rel.cmp(&b.rel));
    Ok(out)
}

fn walk_local(root: &Path, dir: &Path, depth: usize, out: &mut Vec<Listed>, bad: &mut Option<String>) -> std::io::Result<()> {
    if depth > MAX_DEPTH || out.len() > MAX_FILES {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let t = e.file_type()?;
        let path = e.path();
        let rel = path.strip_prefix(root).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
        if t.is_dir() {
            walk_local(root, &path, depth + 1, out, bad)?;
        } else if t.is_file() {
            out.push(Listed { rel, size: e.metadata()?.len() });
        } else if bad.is_none() {
            *bad = Some(rel);
        }
    }
    Ok(())
}

/// Calls `f(relative path, size)` for each plain file under `dir`.
fn walk_files(root: &Path, dir: &Path, depth: usize, f: &mut dyn FnMut(&str, u64)) -> std::io::Result<()> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let t = e.file_type()?;
        if t.is_dir() {
            walk_files(root, &e.path(), depth + 1, f)?;
        } else if t.is_file() {
            let path = e.path();
            let rel = path.strip_prefix(root).map(|p| p.to_string_lossy().into_owned()).unwrap_or_default();
            f(&rel, e.metadata()?.len());
        }
    }
    Ok(())
}

fn walk_all(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        out.push(e.path());
        if e.file_type()?.is_dir() {
            walk_all(&e.path(), depth + 1, out)?;
        }
    }
    Ok(())
}

/// Copies a plain file (never following a symlink at `from`), hashing it.
fn copy_hashed(from: &Path, to: &Path) -> std::io::Result<(String, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut src = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW).open(from)?;
    if !src.metadata()?.is_file() {
        return Err(std::io::Error::other(format!("{} is not a plain file", from.display())));
    }
    let mut dst = std::fs::File::create(to)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = src.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        dst.write_all(&buf[..n])?;
        size += n as u64;
    }
    dst.sync_all()?;
    Ok((hex::encode(hasher.finalize()), size))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_and_ignore_hosts_in_served_uris() {
        assert_eq!(Source::parse("mlflow-artifacts:/1/abc/artifacts/model"), Some(Source::Served("1/abc/artifacts/model".into())));
        assert_eq!(
            Source::parse("mlflow-artifacts://evil.example:80/1/models/m-1/artifacts"),
            Some(Source::Served("1/models/m-1/artifacts".into())),
            "the host is never contacted: only the path is kept"
        );
        assert_eq!(Source::parse("file:///srv/models/a%20b"), Some(Source::Local("/srv/models/a b".into())));
        assert_eq!(Source::parse("file://localhost/srv/m"), Some(Source::Local("/srv/m".into())));
        assert_eq!(Source::parse("/srv/m"), Some(Source::Local("/srv/m".into())));
        for other in ["s3://bucket/m", "runs:/abc/model", "models:/m/1", "http://127.0.0.1:9/x", "file://remote-host/x", "relative/path"] {
            assert_eq!(Source::parse(other), None, "{other}");
        }
    }

    #[test]
    fn listed_names_are_single_components() {
        for bad in ["", ".", "..", "a/b", "a\0b", "a\\b"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_name("model.Q4_1.gguf").is_ok());
        assert!(is_weights("sub/Model.GGUF") && is_weights("x.safetensors") && !is_weights("MLmodel") && !is_weights("conda.yaml"));
    }

    fn cache(dir: &Path, max_gib: f64, roots: Vec<PathBuf>) -> ArtifactCache {
        let c = ArtifactCache::open(dir.to_path_buf(), max_gib, roots, None).unwrap();
        c.ensure_dirs().unwrap();
        c
    }

    /// A `file:` version (no MLflow call needed past the download URI, which these tests
    /// bypass): listing, copying, digest, sealing, the index and the pins.
    #[test]
    fn local_versions_are_copied_whole_and_content_addressed() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("src/v1");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("model.gguf"), b"weights").unwrap();
        std::fs::write(src.join("sub/MLmodel"), b"meta").unwrap();
        let c = cache(&t.path().join("cache"), 1.0, vec![t.path().join("src")]);
        // A partial download left by a crash is gone after open.
        std::fs::create_dir_all(t.path().join("cache/partial/dead")).unwrap();
        let c2 = cache(&t.path().join("cache"), 1.0, vec![t.path().join("src")]);
        assert!(!t.path().join("cache/partial/dead").exists());
        drop(c2);
        let root = c.local_root(&src, "m", "1").unwrap();
        let files = list_local(&root, "m", "1").unwrap();
        assert_eq!(files.iter().map(|f| f.rel.as_str()).collect::<Vec<_>>(), ["model.gguf", "sub/MLmodel"]);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let ml = Mlflow::new("http://127.0.0.1:9");
        let partial = t.path().join("cache/partial/x");
        std::fs::create_dir_all(&partial).unwrap();
        let digest = rt.block_on(c.download(&ml, &Source::Local(root.clone()), &files, &partial, "m", "1")).unwrap();
        assert_eq!(digest.len(), 64);
        c.seal(&partial).unwrap();
        std::fs::rename(partial, t.path().join(format!("cache/sha256-{digest}"))).unwrap();
        c.write_index("m", "1", &digest).unwrap();
        let w = c.cached("m", "1").unwrap();
        assert_eq!(w.model_file.as_deref(), Some(t.path().join(format!("cache/sha256-{digest}/model.gguf")).as_path()));
        assert_eq!(std::fs::read(w.dir.join("sub/MLmodel")).unwrap(), b"meta");
        // The same files give the same digest (content-addressed).
        let again = t.path().join("cache/partial/y");
        std::fs::create_dir_all(&again).unwrap();
        assert_eq!(rt.block_on(c.download(&ml, &Source::Local(root), &files, &again, "m", "1")).unwrap(), digest);
        // Pinned while a worker holds it: eviction cannot remove it.
        let e = c.make_room((1.0 * GIB) as u64, "other", "2").unwrap_err().to_string();
        assert!(e.contains("mlflow.cache_max_gib") && e.contains("running workers"), "{e}");
        drop(w);
        c.make_room((1.0 * GIB) as u64, "other", "2").unwrap();
        assert!(c.cached("m", "1").is_none(), "evicted once no worker used it");
        let e = c.make_room((2.0 * GIB) as u64, "big", "3").unwrap_err().to_string();
        assert!(e.contains("`big` version 3 needs 2.00 GiB") && e.contains("raise it"), "{e}");
    }

    #[test]
    fn local_sources_stay_under_file_roots_and_copy_no_symlinks() {
        let t = tempfile::tempdir().unwrap();
        let allowed = t.path().join("models");
        std::fs::create_dir_all(allowed.join("v1")).unwrap();
        std::fs::write(t.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(t.path().join("secret"), allowed.join("v1/link.gguf")).unwrap();
        std::os::unix::fs::symlink(t.path().join("secret"), allowed.join("escape")).unwrap();
        let none = cache(&t.path().join("c1"), 1.0, vec![]);
        let e = none.local_root(&allowed.join("v1"), "m", "1").unwrap_err().to_string();
        assert!(e.contains("outside mlflow.file_roots (none set)"), "{e}");
        let c = cache(&t.path().join("c2"), 1.0, vec![allowed.clone()]);
        let e = c.local_root(&allowed.join("escape"), "m", "1").unwrap_err().to_string();
        assert!(e.contains("outside mlflow.file_roots"), "a symlink out of the root is outside it: {e}");
        let root = c.local_root(&allowed.join("v1"), "m", "1").unwrap();
        let e = list_local(&root, "m", "1").unwrap_err().to_string();
        assert!(e.contains("link.gguf") && e.contains("symlink"), "{e}");
    }
}

#[cfg(test)]
mod fetch_tests;
