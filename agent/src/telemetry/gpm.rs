//! The profiling series (`DCGM_FI_PROF_*`) through NVML's GPM API (GPU Performance
//! Monitoring, Hopper and later): one GPM sample per GPU per pass, and the metrics between it
//! and the previous pass's sample (`nvmlGpmMetricsGet`), so each value is the mean over the
//! last sampling interval.
//!
//! Mapping (the one DCGM's own GPM path uses, `DcgmFieldIdToNvmlGpmMetricId` in DCGM's
//! `dcgm_fields.cpp`): graphics/SM/SM-occupancy/any-tensor/DRAM utilisation, which NVML gives
//! in percent, become DCGM's 0-1 ratios (`GR_ENGINE_ACTIVE`, `SM_ACTIVE`, `SM_OCCUPANCY`,
//! `PIPE_TENSOR_ACTIVE`, `DRAM_ACTIVE`); PCIe and NVLink traffic, which nvml.h documents in
//! MiB/s, become bytes per second (`PCIE_TX_BYTES`, ..., `NVLINK_RX_BYTES`).
//!
//! A GPU without GPM (`nvmlGpmQueryDeviceSupport` says no: anything before Hopper; or a driver
//! without the GPM symbols) has none of these series; that is reported once per GPU as the
//! unsupported field `gpm`. A single metric the GPU refuses is left out the same way, as
//! `gpm_<metric>`. The first pass that sees a GPU only takes its baseline sample.

use std::collections::HashMap;
use std::sync::Arc;

use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::gpm::gpm_metrics_get;
use nvml_wrapper::{GpmSample, Nvml};

use super::nvml::FieldError;

/// The unsupported/failed field name of GPM as a whole.
pub const FIELD: &str = "gpm";

/// The DCGM profiling values of one GPU over the last interval; `None`: not available.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProfSample {
    /// `DCGM_FI_PROF_GR_ENGINE_ACTIVE` (0-1).
    pub gr_engine_active: Option<f64>,
    /// `DCGM_FI_PROF_SM_ACTIVE` (0-1).
    pub sm_active: Option<f64>,
    /// `DCGM_FI_PROF_SM_OCCUPANCY` (0-1).
    pub sm_occupancy: Option<f64>,
    /// `DCGM_FI_PROF_PIPE_TENSOR_ACTIVE` (0-1).
    pub pipe_tensor_active: Option<f64>,
    /// `DCGM_FI_PROF_DRAM_ACTIVE` (0-1).
    pub dram_active: Option<f64>,
    /// `DCGM_FI_PROF_PCIE_TX_BYTES`, `..._RX_BYTES` (bytes/s).
    pub pcie_tx_bytes: Option<f64>,
    pub pcie_rx_bytes: Option<f64>,
    /// `DCGM_FI_PROF_NVLINK_TX_BYTES`, `..._RX_BYTES` (bytes/s).
    pub nvlink_tx_bytes: Option<f64>,
    pub nvlink_rx_bytes: Option<f64>,
}

/// How NVML's value becomes DCGM's.
#[derive(Clone, Copy)]
enum Scale {
    Percent,
    MibPerSecond,
}

type Slot = fn(&mut ProfSample) -> &mut Option<f64>;

/// The metrics asked for, in one `nvmlGpmMetricsGet` call: (NVML metric, field name, scale,
/// where the value goes). The field names are the fake NVML's script keys too.
const METRICS: [(GpmMetricId, &str, Scale, Slot); 9] = [
    (GpmMetricId::GraphicsUtil, "gpm_gr_engine", Scale::Percent, |p| &mut p.gr_engine_active),
    (GpmMetricId::SmUtil, "gpm_sm_active", Scale::Percent, |p| &mut p.sm_active),
    (GpmMetricId::SmOccupancy, "gpm_sm_occupancy", Scale::Percent, |p| &mut p.sm_occupancy),
    (GpmMetricId::AnyTensorUtil, "gpm_tensor", Scale::Percent, |p| &mut p.pipe_tensor_active),
    (GpmMetricId::DramBwUtil, "gpm_dram", Scale::Percent, |p| &mut p.dram_active),
    (GpmMetricId::PcieTxPerSec, "gpm_pcie_tx", Scale::MibPerSecond, |p| &mut p.pcie_tx_bytes),
    (GpmMetricId::PcieRxPerSec, "gpm_pcie_rx", Scale::MibPerSecond, |p| &mut p.pcie_rx_bytes),
    (GpmMetricId::NvlinkTotalTxPerSec, "gpm_nvlink_tx", Scale::MibPerSecond, |p| &mut p.nvlink_tx_bytes),
    (GpmMetricId::NvlinkTotalRxPerSec, "gpm_nvlink_rx", Scale::MibPerSecond, |p| &mut p.nvlink_rx_bytes),
];

enum State {
    /// GPM works; the previous pass's sample, when there is one.
    Sampling(Option<GpmSample<'static>>),
    /// No GPM on this GPU or driver (reported as unsupported every pass, logged once).
    Unsupported(String),
}

struct Gpu {
    uuid: String,
    state: State,
}

/// The GPM state of one open NVML.
///
/// Field order matters: `gpus` (whose samples borrow the `Nvml` behind `nvml`) is declared
/// first so it drops first, and `Drop` clears it explicitly as well, freeing every sample
/// (`nvmlGpmSampleFree`) while NVML is initialised.
pub struct GpmSampler {
    gpus: HashMap<u32, Gpu>,
    nvml: Arc<Nvml>,
}

impl std::fmt::Debug for GpmSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpmSampler").field("gpus", &self.gpus.len()).finish()
    }
}

impl Drop for GpmSampler {
    fn drop(&mut self) {
        self.gpus.clear();
    }
}

impl GpmSampler {
    pub fn new(nvml: Arc<Nvml>) -> Self {
        Self { gpus: HashMap::new(), nvml }
    }

    /// Forgets GPUs at index `count` and above (frees their samples).
    pub fn retain_below(&mut self, count: u32) {
        self.gpus.retain(|index, _| *index < count);
    }

    /// Takes GPU `index`'s sample of this pass and returns the metrics since the previous one.
    /// Errors (and "not supported") go to `errs`, one per field.
    pub fn poll(&mut self, index: u32, uuid: &str, errs: &mut Vec<FieldError>) -> ProfSample {
        // SAFETY: the `Nvml` lives in an `Arc` allocation that `self.nvml` keeps alive and never
        // moves. Samples borrowing it are stored in `self.gpus` only, which is dropped before
        // `self.nvml` (declaration order, and `Drop` clears it first); the device handle is
        // used only in this function. So no borrow outlives the `Nvml`.
        let nvml: &'static Nvml = unsafe { &*Arc::as_ptr(&self.nvml) };
        let fresh = !matches!(self.gpus.get(&index), Some(g) if g.uuid == uuid);
        if fresh {
            // A new GPU, or another GPU at this index: start over (frees an old sample).
            let state = match nvml.device_by_index(index).and_then(|d| d.gpm_support()) {
                Ok(true) => State::Sampling(None),
                Ok(false) => State::Unsupported("the GPU has no GPM (Hopper or later needed)".into()),
                Err(e @ (NvmlError::NotSupported | NvmlError::FailedToLoadSymbol(_))) => State::Unsupported(e.to_string()),
                Err(e) => {
                    // Asked again next pass.
                    self.gpus.remove(&index);
                    errs.push(FieldError { field: FIELD, error: e.to_string(), unsupported: false });
                    return ProfSample::default();
                }
            };
            self.gpus.insert(index, Gpu { uuid: uuid.to_string(), state });
        }
        let Some(gpu) = self.gpus.get_mut(&index) else { return ProfSample::default() };
        let prev = match &mut gpu.state {
            State::Unsupported(why) => {
                errs.push(FieldError { field: FIELD, error: why.clone(), unsupported: true });
                return ProfSample::default();
            }
            State::Sampling(prev) => prev,
        };
        let new = match nvml.device_by_index(index).and_then(|d| d.gpm_sample()) {
            Ok(s) => s,
            Err(e) => {
                // Without a new sample the old one is no baseline for the next pass either.
                *prev = None;
                errs.push(FieldError { field: FIELD, error: e.to_string(), unsupported: matches!(e, NvmlError::NotSupported) });
                return ProfSample::default();
            }
        };
        let Some(old) = prev.replace(new) else { return ProfSample::default() };
        let Some(new) = prev.as_ref() else { return ProfSample::default() };
        let ids: Vec<GpmMetricId> = METRICS.iter().map(|m| m.0).collect();
        let results = gpm_metrics_get(nvml, &old, new, &ids);
        drop(old); // nvmlGpmSampleFree
        let mut out = ProfSample::default();
        match results {
            Ok(results) => {
                for ((_, field, scale, slot), r) in METRICS.iter().zip(results) {
                    match r {
                        Ok(m) if m.value.is_finite() => {
                            *slot(&mut out) = Some(match scale {
                                Scale::Percent => m.value / 100.0,
                                Scale::MibPerSecond => m.value * 1024.0 * 1024.0,
                            });
                        }
                        Ok(_) => errs.push(FieldError { field, error: "NVML returned no number".into(), unsupported: false }),
                        Err(e) => errs.push(FieldError { field, error: e.to_string(), unsupported: matches!(e, NvmlError::NotSupported) }),
                    }
                }
            }
            Err(e) => errs.push(FieldError { field: FIELD, error: e.to_string(), unsupported: matches!(e, NvmlError::NotSupported) }),
        }
        out
    }
}
