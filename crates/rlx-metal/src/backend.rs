//! `rlx_runtime::Backend` for a Metal device: shared-storage allocations, the blit copy engine,
//! programs run by `crate::program` (every instruction the CPU backend runs), and the options a
//! program is compiled with: whether large matmuls go to the matrix engine (`RLX_METAL_MPSGRAPH`;
//! attention: `RLX_METAL_MPSGRAPH_ATTENTION`, by default as the matmuls)
//! and where the training update runs (`RLX_METAL_UPDATE`: a Metal kernel, the default, or the
//! host with the function the backend is given).
use crate::matmul::MatmulPolicy;
use crate::MetalDevice;
use rlx_ir::{Error, Result};
use rlx_runtime::{Backend, Compiled, CopyEngine, DeviceBuffer, OptimHyper, Program, UpdatePlan};
use std::sync::Arc;

/// Runs a training update in place on the host over host-visible buffers, checking it first
/// against buffers of the given lengths: `rlx_cpu::host_update`, passed in by whoever builds
/// the backend (rlx-metal does not depend on the CPU backend, whose x86_64 build needs a newer
/// Rust than rlx-metal's 1.85).
///
/// # Safety (of calling it)
/// As `Compiled::run`: nothing else touches the buffers' bytes during the call.
pub type HostUpdate =
    unsafe fn(&[&dyn DeviceBuffer], &[usize], &UpdatePlan, Option<&OptimHyper>) -> Result<()>;

/// Where a program's training update runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum UpdateMode {
    /// One multi-tensor MSL kernel (with its norm, control and step-count kernels) in the
    /// step's command buffer, hyper-parameters read from a device buffer: the step never waits
    /// for the GPU halfway. The default.
    #[default]
    Kernel,
    /// The CPU backend's update kernels on the host, in place over the shared memory, after the
    /// GPU finished the step's earlier work (the step is two command buffers and a host wait).
    Host,
}

impl UpdateMode {
    /// The mode a value of `RLX_METAL_UPDATE` asks for: unset or empty and `kernel` give
    /// `Kernel`, `host` gives `Host`; anything else is an `Input` error.
    pub fn parse(value: Option<&str>) -> Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("kernel") => Ok(Self::Kernel),
            Some("host") => Ok(Self::Host),
            Some(v) => Err(Error::input(
                "RLX_METAL_UPDATE",
                format!("must be kernel or host, not {v:?}"),
            )),
        }
    }
}

/// How the backend compiles programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct MetalOptions {
    /// Which matmuls run on the matrix engine.
    pub matmul: MatmulPolicy,
    /// Which attentions (forward and gradient) run on the matrix engine (`crate::attention`).
    pub attention: MatmulPolicy,
    pub update: UpdateMode,
}

impl MetalOptions {
    /// The options the environment asks for (`RLX_METAL_MPSGRAPH`,
    /// `RLX_METAL_MPSGRAPH_ATTENTION`, `RLX_METAL_UPDATE`).
    pub fn from_env() -> Result<Self> {
        let matmul = MatmulPolicy::from_env()?;
        Ok(Self {
            matmul,
            attention: crate::attention::policy(
                matmul,
                std::env::var("RLX_METAL_MPSGRAPH_ATTENTION")
                    .ok()
                    .as_deref(),
            )?,
            update: UpdateMode::parse(std::env::var("RLX_METAL_UPDATE").ok().as_deref())?,
        })
    }
}

/// The Metal backend over one device (real, or host-emulated in tests).
pub struct MetalBackend {
    device: MetalDevice,
    host_update: HostUpdate,
    /// `None`: read from the environment at every compile.
    options: Option<MetalOptions>,
}

impl MetalBackend {
    /// A backend whose programs are compiled with the environment's options.
    pub fn new(device: MetalDevice, host_update: HostUpdate) -> Self {
        Self {
            device,
            host_update,
            options: None,
        }
    }
    /// A backend whose programs are compiled with `options`, whatever the environment says.
    pub fn with_options(
        device: MetalDevice,
        host_update: HostUpdate,
        options: MetalOptions,
    ) -> Self {
        Self {
            device,
            host_update,
            options: Some(options),
        }
    }
    pub fn device(&self) -> &MetalDevice {
        &self.device
    }
}

impl Backend for MetalBackend {
    fn name(&self) -> String {
        "metal".into()
    }
    fn alignment(&self) -> usize {
        256
    }
    fn alloc(&self, bytes: usize) -> Result<Arc<dyn DeviceBuffer>> {
        Ok(self.device.alloc(bytes)?)
    }
    fn compile(&self, program: &Program, buffer_lens: &[usize]) -> Result<Box<dyn Compiled>> {
        let options = match self.options {
            Some(o) => o,
            None => MetalOptions::from_env()?,
        };
        Ok(Box::new(crate::program::MetalProgram::new(
            self.device.clone(),
            program,
            buffer_lens,
            self.host_update,
            options,
        )?))
    }
    fn copy_engine(&self) -> Result<Arc<CopyEngine>> {
        Ok(self.device.copy_engine()?)
    }
    /// Integers are int32 in the kernels: int64 and bool inside a program work; at its edges
    /// (inputs, outputs) they are a `DTypeError` (no bool or int64 casts in MSL yet).
    fn narrows_integers(&self) -> bool {
        true
    }
}
