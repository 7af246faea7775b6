//! NVML access through nvml-wrapper: open the library, read one [`GpuSample`] per GPU.
//!
//! The same code runs against the real driver and against `tests/fake-nvml/` (an
//! NVML-compatible library the tests build), because nvml-wrapper loads NVML at run time.
//! Every field is read on its own: a field NVML refuses (`NotSupported` on this GPU, or a
//! transient error) is left out of this sample and reported in [`GpuSample::errors`]; it never
//! fails the sample. Only losing NVML itself (the device count) fails [`NvmlSource::sample`].
//! XID errors come from NVML's event API instead of a read ([`super::xid`]); each sample
//! drains the events that arrived since the previous one.
//!
//! Calls block (a real driver takes milliseconds per call), so this runs on the sampler thread.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;

use nvml_wrapper::Nvml;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;

use super::xid::XidEvents;

/// One compute process NVML reports on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcSample {
    pub pid: u32,
    /// VRAM the process holds (bytes); `None` when the driver cannot tell.
    pub used_bytes: Option<u64>,
    /// SM utilisation (percent) from the newest process-utilisation sample, when there is one.
    pub sm_util: Option<u32>,
}

/// A field NVML refused for one GPU in one sample.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field name as used in the `field` label of `gpuhub_telemetry_nvml_errors_total`.
    pub field: &'static str,
    pub error: String,
    /// `NotSupported`: a property of the GPU, not a fault (counted separately, logged once).
    pub unsupported: bool,
}

/// Everything read from one GPU in one sample; `None` fields were refused by NVML.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuSample {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub pci_bus_id: String,
    pub util_percent: Option<u32>,
    pub mem_copy_util_percent: Option<u32>,
    pub memory_total_bytes: Option<u64>,
    pub memory_used_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub temperature_c: Option<u32>,
    pub power_mw: Option<u32>,
    /// Energy counter since the driver loaded (millijoules).
    pub energy_mj: Option<u64>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    /// XID codes NVML reported since the previous sample, oldest first. `None` when the GPU is
    /// not watched for XIDs (not supported, or registration failed; see `errors`).
    pub xid_events: Option<Vec<u64>>,
    /// `None` when the process list itself was refused (then no job attribution this sample).
    pub processes: Option<Vec<ProcSample>>,
    pub errors: Vec<FieldError>,
}

/// Static identity of a GPU, read once per index.
#[derive(Debug, Clone)]
struct Identity {
    uuid: String,
    name: String,
    pci_bus_id: String,
}

/// An open NVML library.
pub struct NvmlSource {
    nvml: Arc<Nvml>,
    xid: XidEvents,
    identities: HashMap<u32, Identity>,
    /// Newest process-utilisation timestamp seen per GPU index (NVML returns newer samples only).
    last_proc_ts: HashMap<u32, u64>,
}

impl std::fmt::Debug for NvmlSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlSource").field("gpus", &self.identities.len()).finish()
    }
}

impl NvmlSource {
    /// Loads and initialises NVML: `lib` or the driver's `libnvidia-ml.so.1`.
    ///
    /// A node without the driver gives `LibloadingError` (no library), `FailedToLoadSymbol` (a
    /// wrong one), `DriverNotLoaded` or `LibraryNotFound`: all mean "no NVML" to the caller.
    pub fn open(lib: Option<&Path>) -> Result<Self, NvmlError> {
        let nvml = match lib {
            Some(path) => Nvml::builder().lib_path(OsStr::new(path.as_os_str())).init()?,
            None => Nvml::init()?,
        };
        let nvml = Arc::new(nvml);
        Ok(Self { xid: XidEvents::new(Arc::clone(&nvml)), nvml, identities: HashMap::new(), last_proc_ts: HashMap::new() })
    }

    /// The driver version, for the startup log line.
    pub fn driver_version(&self) -> Option<String> {
        self.nvml.sys_driver_version().ok()
    }

    /// Samples every GPU. `Err` only when the device count cannot be read (NVML gone).
    pub fn sample(&mut self) -> Result<Vec<GpuSample>, NvmlError> {
        let count = self.nvml.device_count()?;
        if self.identities.len() > count as usize {
            self.identities.clear();
        }
        self.xid.retain_below(count);
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = match self.nvml.device_by_index(index) {
                Ok(d) => d,
                Err(e) => {
                    out.push(GpuSample {
                        index,
                        errors: vec![FieldError { field: "handle", error: e.to_string(), unsupported: false }],
                        ..GpuSample::default()
                    });
                    continue;
                }
            };
            let mut s = GpuSample { index, ..GpuSample::default() };
            let mut errs = Vec::new();

            let identity = match self.identities.get(&index) {
                Some(id) => Some(id.clone()),
                None => match device.uuid() {
                    Ok(uuid) => {
                        let name = field(&mut errs, "name", device.name()).unwrap_or_else(|| "unknown".into());
                        let pci_bus_id = field(&mut errs, "pci", device.pci_info()).map(|p| p.bus_id).unwrap_or_default();
                        let id = Identity { uuid, name, pci_bus_id };
                        self.identities.insert(index, id.clone());
                        Some(id)
                    }
                    Err(e) => {
                        errs.push(field_error("uuid", &e));
                        None
                    }
                },
            };
            // Series are keyed by UUID; a GPU whose UUID NVML will not give is left out.
            let Some(identity) = identity else {
                s.errors = errs;
                out.push(s);
                continue;
            };
            s.uuid = identity.uuid;
            s.name = identity.name;
            s.pci_bus_id = identity.pci_bus_id;

            if let Some(u) = field(&mut errs, "util", device.utilization_rates()) {
                s.util_percent = Some(u.gpu);
                s.mem_copy_util_percent = Some(u.memory);
            }
            if let Some(m) = field(&mut errs, "mem", device.memory_info()) {
                s.memory_total_bytes = Some(m.total);
                s.memory_used_bytes = Some(m.used);
                s.memory_free_bytes = Some(m.free);
            }
            s.temperature_c = field(&mut errs, "temp", device.temperature(TemperatureSensor::Gpu));
            s.power_mw = field(&mut errs, "power", device.power_usage());
            s.energy_mj = field(&mut errs, "energy", device.total_energy_consumption());
            s.sm_clock_mhz = field(&mut errs, "clock", device.clock_info(Clock::SM));
            s.mem_clock_mhz = field(&mut errs, "clock", device.clock_info(Clock::Memory));
            s.ecc_corrected = field(&mut errs, "ecc", device.total_ecc_errors(MemoryError::Corrected, EccCounter::Volatile));
            if s.ecc_corrected.is_some() {
                s.ecc_uncorrected = field(&mut errs, "ecc", device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile));
            }
            let xid = self.xid.poll(index, &s.uuid);
            s.xid_events = xid.codes;
            errs.extend(xid.error);

            if let Some(procs) = field(&mut errs, "procs", device.running_compute_processes()) {
                let last = self.last_proc_ts.get(&index).copied();
                let mut util: HashMap<u32, (u64, u32)> = HashMap::new();
                match device.process_utilization_stats(last) {
                    Ok(samples) => {
                        for u in samples {
                            let e = util.entry(u.pid).or_insert((0, 0));
                            if u.timestamp >= e.0 {
                                *e = (u.timestamp, u.sm_util);
                            }
                        }
                        if let Some(max) = util.values().map(|(ts, _)| *ts).max() {
                            self.last_proc_ts.insert(index, max);
                        }
                    }
                    // No sample newer than `last`: the processes were idle since.
                    Err(NvmlError::NotFound) => {}
                    Err(e) => errs.push(field_error("proc_util", &e)),
                }
                let have_util = !util.is_empty() || errs.iter().all(|e| e.field != "proc_util");
                s.processes = Some(
                    procs
                        .into_iter()
                        .map(|p| ProcSample {
                            pid: p.pid,
                            used_bytes: match p.used_gpu_memory {
                                UsedGpuMemory::Used(b) => Some(b),
                                UsedGpuMemory::Unavailable => None,
                            },
                            sm_util: match util.get(&p.pid) {
                                Some((_, u)) => Some(*u),
                                None if have_util => Some(0),
                                None => None,
                            },
                        })
                        .collect(),
                );
            }
            s.errors = errs;
            out.push(s);
        }
        Ok(out)
    }
}

fn field_error(field: &'static str, e: &NvmlError) -> FieldError {
    FieldError { field, error: e.to_string(), unsupported: matches!(e, NvmlError::NotSupported) }
}

/// Keeps a field's value, or notes why NVML refused it.
fn field<T>(errs: &mut Vec<FieldError>, name: &'static str, r: Result<T, NvmlError>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            errs.push(field_error(name, &e));
            None
        }
    }
}
