//! NVML access through nvml-wrapper: open the library, read one [`GpuSample`] per GPU.
//!
//! The same code runs against the real driver and against `tests/fake-nvml/` (an
//! NVML-compatible library the tests build), because nvml-wrapper loads NVML at run time.
//! Every field is read on its own: a field NVML refuses (`NotSupported` on this GPU, or a
//! transient error) is left out of this sample and reported in [`GpuSample::errors`]; it never
//! fails the sample. Only losing NVML itself (the device count) fails [`NvmlSource::sample`].
//! XID errors come from NVML's event API instead of a read ([`super::xid`]); each sample
//! drains the events that arrived since the previous one. The profiling series come from GPM
//! ([`super::gpm`]). Memory temperature, row remapping and NVLink traffic come from one
//! `nvmlDeviceGetFieldValues` call per GPU (the NVML fields DCGM reads for them).
//!
//! Calls block (a real driver takes milliseconds per call), so this runs on the sampler thread.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::Path;
use std::sync::Arc;

use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, PcieUtilCounter, TemperatureSensor};
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::{NvmlError, nvml_try};
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings::field_id::{
    NVML_FI_DEV_MEMORY_TEMP, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_REMAPPED_COR,
    NVML_FI_DEV_REMAPPED_FAILURE, NVML_FI_DEV_REMAPPED_UNC,
};
use nvml_wrapper_sys::bindings::nvmlFieldValue_t;

use super::gpm::{GpmSampler, ProfSample};
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
    pub memory_reserved_bytes: Option<u64>,
    pub temperature_c: Option<u32>,
    /// HBM temperature (`NVML_FI_DEV_MEMORY_TEMP`).
    pub memory_temp_c: Option<u32>,
    pub power_mw: Option<u32>,
    /// Energy counter since the driver loaded (millijoules).
    pub energy_mj: Option<u64>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub ecc_corrected: Option<u64>,
    pub ecc_uncorrected: Option<u64>,
    /// PCIe throughput (KB/s over NVML's 20 ms window), transmitted and received.
    pub pcie_tx_kbs: Option<u32>,
    pub pcie_rx_kbs: Option<u32>,
    pub pcie_replays: Option<u32>,
    pub enc_util_percent: Option<u32>,
    pub dec_util_percent: Option<u32>,
    /// NVLink data traffic, TX + RX of all links, over the last interval, in DCGM's unit for
    /// `DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL` (KiB counter delta per second / 1000, "MB/s").
    /// `None` on the first sample (no interval yet).
    pub nvlink_bandwidth: Option<f64>,
    pub remapped_rows_correctable: Option<u32>,
    pub remapped_rows_uncorrectable: Option<u32>,
    /// 1 when row remapping failed on the GPU.
    pub row_remap_failure: Option<u32>,
    /// GPM profiling values since the previous sample.
    pub prof: ProfSample,
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
    gpm: GpmSampler,
    identities: HashMap<u32, Identity>,
    /// Previous NVLink data counter per GPU index: (UUID, KiB TX+RX, NVML's timestamp in µs).
    prev_nvlink: HashMap<u32, (String, u64, i64)>,
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
        Ok(Self {
            xid: XidEvents::new(Arc::clone(&nvml)),
            gpm: GpmSampler::new(Arc::clone(&nvml)),
            nvml,
            identities: HashMap::new(),
            prev_nvlink: HashMap::new(),
            last_proc_ts: HashMap::new(),
        })
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
        self.gpm.retain_below(count);
        self.prev_nvlink.retain(|index, _| *index < count);
        let nvml = Arc::clone(&self.nvml);
        let mut out = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = match nvml.device_by_index(index) {
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
                s.memory_reserved_bytes = Some(m.reserved);
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
            s.pcie_tx_kbs = field(&mut errs, "pcie_throughput", device.pcie_throughput(PcieUtilCounter::Send));
            if s.pcie_tx_kbs.is_some() {
                s.pcie_rx_kbs = field(&mut errs, "pcie_throughput", device.pcie_throughput(PcieUtilCounter::Receive));
            }
            s.pcie_replays = field(&mut errs, "pcie_replay", device.pcie_replay_counter());
            s.enc_util_percent = field(&mut errs, "enc_util", device.encoder_utilization()).map(|u| u.utilization);
            s.dec_util_percent = field(&mut errs, "dec_util", device.decoder_utilization()).map(|u| u.utilization);
            self.read_field_values(&nvml, &device, &mut s, &mut errs);
            s.prof = self.gpm.poll(index, &s.uuid, &mut errs);
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

impl NvmlSource {
    /// Memory temperature, row remapping and NVLink traffic: one `nvmlDeviceGetFieldValues`
    /// call (nvml-wrapper's `field_values_for` cannot set `scopeId`, and the NVLink counters
    /// need `scopeId = UINT_MAX`, "all links", as DCGM passes it).
    fn read_field_values(&mut self, nvml: &Nvml, device: &Device<'_>, s: &mut GpuSample, errs: &mut Vec<FieldError>) {
        const ALL_LINKS: u32 = u32::MAX;
        const IDS: [(u32, u32); 6] = [
            (NVML_FI_DEV_MEMORY_TEMP, 0),
            (NVML_FI_DEV_REMAPPED_COR, 0),
            (NVML_FI_DEV_REMAPPED_UNC, 0),
            (NVML_FI_DEV_REMAPPED_FAILURE, 0),
            (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, ALL_LINKS),
            (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, ALL_LINKS),
        ];
        let all_fail = |errs: &mut Vec<FieldError>, e: &NvmlError| {
            for f in ["memory_temp", "remapped_rows", "nvlink_bandwidth"] {
                errs.push(field_error(f, e));
            }
        };
        let sym = match nvml.lib().nvmlDeviceGetFieldValues.as_ref() {
            Ok(sym) => *sym,
            Err(e) => return all_fail(errs, &NvmlError::FailedToLoadSymbol(e.to_string())),
        };
        // SAFETY: nvmlFieldValue_t is plain data (integers and a union of numbers); all-zero is
        // a valid value. The array outlives the call, `count` is its length, and the device
        // handle comes from this NVML (nvml-wrapper's Device), as nvmlDeviceGetFieldValues
        // requires; NVML writes only the `count` entries.
        let mut values: [nvmlFieldValue_t; IDS.len()] = unsafe { std::mem::zeroed() };
        for (v, (id, scope)) in values.iter_mut().zip(IDS) {
            v.fieldId = id;
            v.scopeId = scope;
        }
        // SAFETY: see above.
        let rc = unsafe { sym(device.handle(), IDS.len() as i32, values.as_mut_ptr()) };
        if let Err(e) = nvml_try(rc) {
            return all_fail(errs, &e);
        }
        let get = |i: usize| -> Result<u64, NvmlError> {
            let v = &values[i];
            nvml_try(v.nvmlReturn)?;
            field_value_u64(v).ok_or(NvmlError::UnexpectedVariant(v.valueType))
        };
        // NVML_FI_DEV_MEMORY_TEMP: some drivers (r545, nvbugs/4300930) label the value a double
        // while writing `uiVal`; DCGM reads `uiVal` regardless, and so do we.
        match nvml_try(values[0].nvmlReturn) {
            // SAFETY: reading a union member of a plain-number union is always defined here.
            Ok(()) => match unsafe { values[0].value.uiVal } {
                t if t <= 200 => s.memory_temp_c = Some(t),
                t => errs.push(FieldError { field: "memory_temp", error: format!("implausible {t} C"), unsupported: false }),
            },
            Err(e) => errs.push(field_error("memory_temp", &e)),
        }
        match (get(1), get(2), get(3)) {
            (Ok(c), Ok(u), Ok(f)) => {
                s.remapped_rows_correctable = Some(u32::try_from(c).unwrap_or(u32::MAX));
                s.remapped_rows_uncorrectable = Some(u32::try_from(u).unwrap_or(u32::MAX));
                s.row_remap_failure = Some(u32::from(f != 0));
            }
            (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => errs.push(field_error("remapped_rows", &e)),
        }
        match (get(4), get(5)) {
            (Ok(tx), Ok(rx)) => {
                let total = tx.saturating_add(rx);
                let ts = [values[4].timestamp, values[5].timestamp].into_iter().max().filter(|t| *t > 0).unwrap_or_else(now_us);
                let prev = self.prev_nvlink.insert(s.index, (s.uuid.clone(), total, ts));
                // DCGM's ReadAndCacheNvLinkBandwidth: delta / seconds / 1000.
                s.nvlink_bandwidth = match prev {
                    Some((uuid, old, old_ts)) if uuid == s.uuid && total >= old && ts > old_ts => {
                        Some((total - old) as f64 / ((ts - old_ts) as f64 / 1e6) / 1000.0)
                    }
                    _ => None,
                };
            }
            (Err(e), _) | (_, Err(e)) => {
                self.prev_nvlink.remove(&s.index);
                errs.push(field_error("nvlink_bandwidth", &e));
            }
        }
    }
}

/// A field value as an unsigned integer, by its declared type; `None` for a negative or
/// unknown one.
fn field_value_u64(v: &nvmlFieldValue_t) -> Option<u64> {
    // SAFETY: every member of nvmlValue_t is a plain number; reading the one `valueType`
    // names is what NVML documents.
    unsafe {
        match v.valueType {
            0 => Some(v.value.dVal).filter(|d| d.is_finite() && *d >= 0.0).map(|d| d as u64),
            1 => Some(u64::from(v.value.uiVal)),
            2 => Some(v.value.ulVal),
            3 => Some(v.value.ullVal),
            4 => u64::try_from(v.value.sllVal).ok(),
            5 => u64::try_from(v.value.siVal).ok(),
            6 => Some(u64::from(v.value.usVal)),
            _ => None,
        }
    }
}

fn now_us() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_micros() as i64).unwrap_or(0)
}

fn field_error(field: &'static str, e: &NvmlError) -> FieldError {
    // A driver without the function is a driver without the feature.
    FieldError { field, error: e.to_string(), unsupported: matches!(e, NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_)) }
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
