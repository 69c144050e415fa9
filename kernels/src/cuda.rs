//! The CUDA kernels (feature `cuda`): CUDA C sources compiled to PTX at run time by NVRTC through
//! cudarc, and run on a GPU where a driver is present.
//!
//! - [`compile_all`] needs only NVRTC (`libnvrtc.so.12`, e.g. from the `nvidia-cuda-nvrtc-cu12`
//!   wheel on `LD_LIBRARY_PATH`), no GPU: CI compiles every kernel on a CPU-only machine.
//! - [`device::run`] needs `libcuda` and a GPU. cudarc *panics* when it cannot load `libcuda`
//!   (`/work/shared/reference/cuda-on-this-machine.md`), so [`probe_driver`] dlopens it first and a
//!   missing driver is the typed [`DriverMissing`], never a panic. [`probe_nvrtc`] does the same
//!   for NVRTC before [`compile_all`] touches it.
//!
//! This module and [`device`] are the only places in the crate with `unsafe`: the probes
//! (cudarc's `is_culib_present` is an `unsafe fn`: it dlopens a library, running its
//! initialisers) and the kernel launches.
#![allow(unsafe_code)]

pub mod device;
pub mod plan;
mod source;

use cudarc::nvrtc::{self, CompileError, CompileOptions};

use crate::KernelError;
pub use source::{CudaSource, SOURCES, WORDS};

/// One CUDA source compiled: its name, PTX text and the kernel entries found in the PTX.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompiledKernel {
    /// The source's name (`kvh_permute`, `kvh_regroup`, `kvh_heads`).
    pub name: &'static str,
    /// The PTX NVRTC produced.
    pub ptx: String,
    /// The `.entry` kernels the PTX defines (each family at every word size).
    pub entries: Vec<String>,
}

/// `libcuda` cannot be loaded: no driver on this machine (or not on the loader's path).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "no CUDA driver: none of libcuda.so, libcuda.so.1 (and cudarc's other names) could be loaded"
)]
pub struct DriverMissing;

/// Whether NVRTC can be loaded, by the names cudarc tries.
///
/// # Errors
/// [`KernelError::NvrtcUnavailable`] when none of them loads.
pub fn probe_nvrtc() -> Result<(), KernelError> {
    // SAFETY: dlopens each of cudarc's candidate names for libnvrtc and closes it again; loading
    // NVRTC runs no initialiser with preconditions of ours. Without this check, cudarc's first
    // NVRTC call panics when the library is missing.
    if unsafe { nvrtc::sys::is_culib_present() } {
        return Ok(());
    }
    let mut names: Vec<String> = Vec::new();
    for name in cudarc::get_lib_name_candidates("nvrtc") {
        if name.starts_with("libnvrtc.so") && !names.contains(&name) {
            names.push(name);
        }
    }
    Err(KernelError::NvrtcUnavailable {
        reason: format!(
            "none of {} could be loaded; put the nvidia-cuda-nvrtc-cu12 wheel's \
             nvidia/cuda_nvrtc/lib on LD_LIBRARY_PATH",
            names.join(", ")
        ),
    })
}

/// Whether the CUDA driver library can be loaded. Call before anything in `cudarc::driver`.
///
/// # Errors
/// [`DriverMissing`] when it cannot.
pub fn probe_driver() -> Result<(), DriverMissing> {
    // SAFETY: as in `probe_nvrtc`, for libcuda: dlopen and dlclose, nothing else.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(DriverMissing)
    }
}

/// The NVRTC version, once [`probe_nvrtc`] succeeded.
///
/// # Errors
/// [`KernelError::NvrtcUnavailable`] when NVRTC cannot be loaded or answer.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    probe_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is loadable (probed above); the two out-pointers are valid for the call.
    unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| KernelError::NvrtcUnavailable {
            reason: format!("nvrtcVersion failed: {e:?}"),
        })?;
    Ok((major, minor))
}

/// Compiles every CUDA source of the crate to PTX with NVRTC, and checks that each PTX defines
/// every kernel entry its source instantiates. Needs NVRTC, not a GPU.
///
/// # Errors
/// [`KernelError::NvrtcUnavailable`] when NVRTC cannot be loaded; [`KernelError::Compile`] when a
/// source does not compile or its PTX lacks an entry.
pub fn compile_all() -> Result<Vec<CompiledKernel>, KernelError> {
    probe_nvrtc()?;
    SOURCES.iter().map(compile).collect()
}

/// Compiles one source.
fn compile(source: &CudaSource) -> Result<CompiledKernel, KernelError> {
    let options = CompileOptions {
        name: Some(format!("{}.cu", source.name)),
        ..CompileOptions::default()
    };
    let ptx = nvrtc::compile_ptx_with_opts(source.text(), options)
        .map_err(|e| KernelError::Compile {
            kernel: source.name,
            log: compile_log(&e),
        })?
        .to_src();
    let entries = source.entries();
    for entry in &entries {
        if !ptx.contains(&format!(".entry {entry}(")) {
            return Err(KernelError::Compile {
                kernel: source.name,
                log: format!("the PTX has no entry {entry}"),
            });
        }
    }
    Ok(CompiledKernel {
        name: source.name,
        ptx,
        entries,
    })
}

fn compile_log(e: &CompileError) -> String {
    match e {
        CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

#[cfg(test)]
mod tests;
