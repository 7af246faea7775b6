//! XID errors through NVML's event API: one event set per GPU, registered for
//! `CRITICAL_XID_ERROR`, drained without waiting on every sample.
//!
//! NVML reports XIDs only as events (there is no counter to read), so a GPU is watched from the
//! sample that first sees it; XIDs from before that are not delivered (NVML: "events that
//! occurred before this call was made will not be recorded"). One set per GPU rather than one
//! shared set because nvml-wrapper frees the set when a registration fails: a GPU that refuses
//! (`NotSupported`, e.g. some vGPU/MIG setups) must not end the watch of the others.
//!
//! Draining calls `nvmlEventSetWait_v2` with a 0 ms timeout until it answers `Timeout`, at most
//! [`MAX_EVENTS_PER_POLL`] times per GPU and sample, so the sampler never blocks here.
//!
//! NVML quirk: when several XIDs happen between two waits, every one of those events carries
//! the *last* XID code (nvml-wrapper's `EventSet::wait` docs). The count is right; the codes of
//! a burst may all read as its last one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{EventSet, Nvml};

use super::nvml::FieldError;

/// Field name of XID watching in `FieldError` (and so in the `field` label of
/// `gpuhub_telemetry_nvml_errors_total`, and in the fake NVML's `fail=`/`unsupported=`).
pub const FIELD: &str = "xid";
/// How long after a failed registration (or a failed wait) the GPU is registered again.
const RETRY: Duration = Duration::from_secs(60);
/// Upper bound on events taken from one GPU's set per sample; the rest wait for the next one.
pub const MAX_EVENTS_PER_POLL: usize = 256;
/// The XID code NVML reports when it does not know the code (`XidError::Unknown`).
pub const UNKNOWN_XID: u64 = 999;

/// What one poll of one GPU gave.
#[derive(Debug, Default)]
pub struct XidPoll {
    /// XID codes received since the previous poll, oldest first; `None` when the GPU is not
    /// watched (no XID support, or registration failed), so "no XID" cannot be claimed.
    pub codes: Option<Vec<u64>>,
    pub error: Option<FieldError>,
}

enum State {
    Watching(EventSet<'static>),
    Unsupported,
    Failed { error: String, retry_at: Instant },
}

struct Watch {
    uuid: String,
    state: State,
}

/// The XID watches of one open NVML.
///
/// Field order matters: `watches` (whose event sets borrow the `Nvml` behind `nvml`) is
/// declared first so it drops first, and `Drop` clears it explicitly as well.
pub struct XidEvents {
    watches: HashMap<u32, Watch>,
    nvml: Arc<Nvml>,
}

impl std::fmt::Debug for XidEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XidEvents").field("gpus", &self.watches.len()).finish()
    }
}

impl Drop for XidEvents {
    fn drop(&mut self) {
        // Frees every event set (nvmlEventSetFree) while NVML is still initialised.
        self.watches.clear();
    }
}

impl XidEvents {
    pub fn new(nvml: Arc<Nvml>) -> Self {
        Self { watches: HashMap::new(), nvml }
    }

    /// Forgets GPUs at index `count` and above (they left NVML's device list).
    pub fn retain_below(&mut self, count: u32) {
        self.watches.retain(|index, _| *index < count);
    }

    /// Drains GPU `index`'s pending XID events, registering it first when it is new (or its
    /// UUID changed, or a failed registration is due for a retry). Never waits.
    pub fn poll(&mut self, index: u32, uuid: &str) -> XidPoll {
        let due = match self.watches.get(&index) {
            None => true,
            Some(w) if w.uuid != uuid => true,
            Some(Watch { state: State::Failed { retry_at, .. }, .. }) => Instant::now() >= *retry_at,
            Some(_) => false,
        };
        if due {
            let state = match self.register(index) {
                Ok(set) => State::Watching(set),
                // A driver too old to have the event API lacks its symbols: same as no support.
                Err(NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) => State::Unsupported,
                Err(e) => State::Failed { error: e.to_string(), retry_at: Instant::now() + RETRY },
            };
            // Replacing an old watch frees its set here.
            self.watches.insert(index, Watch { uuid: uuid.to_string(), state });
        }
        let Some(watch) = self.watches.get_mut(&index) else { return XidPoll::default() };
        let set = match &watch.state {
            State::Watching(set) => set,
            State::Unsupported => {
                let error = NvmlError::NotSupported.to_string();
                return XidPoll { codes: None, error: Some(FieldError { field: FIELD, error, unsupported: true }) };
            }
            State::Failed { error, .. } => {
                let error = error.clone();
                return XidPoll { codes: None, error: Some(FieldError { field: FIELD, error, unsupported: false }) };
            }
        };
        let mut codes = Vec::new();
        let mut failure = None;
        for _ in 0..MAX_EVENTS_PER_POLL {
            match set.wait(0) {
                Ok(ev) => match ev.event_data {
                    Some(XidError::Value(code)) => codes.push(code),
                    Some(XidError::Unknown) => codes.push(UNKNOWN_XID),
                    None => {} // not an XID event (only XIDs are registered)
                },
                Err(NvmlError::Timeout) => break,
                Err(e) => {
                    failure = Some(format!("waiting for XID events: {e}"));
                    break;
                }
            }
        }
        // The set is unusable (GPU lost, driver trouble): keep the XIDs already taken, free
        // the set, register again later.
        let error = failure.map(|error| {
            watch.state = State::Failed { error: error.clone(), retry_at: Instant::now() + RETRY };
            FieldError { field: FIELD, error, unsupported: false }
        });
        XidPoll { codes: Some(codes), error }
    }

    /// A new event set with GPU `index` registered for XID events.
    fn register(&self, index: u32) -> Result<EventSet<'static>, NvmlError> {
        // SAFETY: the `Nvml` lives in an `Arc` allocation that `self.nvml` keeps alive and never
        // moves. The returned set (and the device handle, used only in this function) borrow
        // it; the set is stored in `self.watches` only, which is dropped before `self.nvml`
        // (declaration order, and `Drop` clears it first). So no borrow outlives the `Nvml`.
        let nvml: &'static Nvml = unsafe { &*Arc::as_ptr(&self.nvml) };
        let device = nvml.device_by_index(index)?;
        if !device.supported_event_types()?.contains(EventTypes::CRITICAL_XID_ERROR) {
            return Err(NvmlError::NotSupported);
        }
        let set = nvml.create_event_set()?;
        device.register_events(EventTypes::CRITICAL_XID_ERROR, set).map_err(|e| e.error)
    }
}

/// What an XID usually means, for the XIDs admins act on (NVIDIA's XID catalog); `None` for
/// the rest, which the log line then names by number only.
pub fn hint(code: u64) -> Option<&'static str> {
    Some(match code {
        13 => "graphics engine exception (often the application)",
        31 => "GPU memory page fault (often the application)",
        43 => "GPU stopped processing",
        45 => "preemptive cleanup after earlier errors",
        48 => "double-bit ECC error",
        61 | 62 => "internal micro-controller breakpoint/halt",
        63 => "ECC page retirement or row remapping recorded",
        64 => "ECC page retirement or row remapping failed",
        74 => "NVLink error",
        79 => "GPU has fallen off the bus",
        92 => "high single-bit ECC error rate",
        94 => "contained ECC error",
        95 => "uncontained ECC error",
        119 | 120 => "GSP firmware error",
        _ => return None,
    })
}
