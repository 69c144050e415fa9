//! The CUDA kernels on a GPU: each run on the benchmark's workload, its output compared with
//! the CPU kernel's, its bandwidth measured with CUDA events against a device-to-device copy.
//!
//! [`run`] probes `libcuda` first ([`probe_driver`](super::probe_driver())): on a machine without
//! a driver it returns [`DeviceError::NoDriver`] and never reaches cudarc's driver API (which
//! would panic).

use std::collections::BTreeMap;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use super::plan::{plan, Arg};
use super::{probe_driver, CompiledKernel, DriverMissing};
use crate::bench::{fill_random, Case, Workload};
use crate::KernelError;

/// What [`run`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceOptions {
    /// The workload, as for the CPU kernels.
    pub workload: Workload,
    /// Timed launches of each kernel (after one untimed one).
    pub rounds: usize,
    /// Seed of the input bytes.
    pub seed: u64,
    /// Threads of the CPU kernels computing the expected outputs.
    pub threads: usize,
}

/// One kernel's result on the GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceKernel {
    /// The case's name.
    pub name: String,
    /// GB/s of output bytes (mean over the timed launches).
    pub gbps: f64,
    /// Whether the GPU's output equals the CPU kernel's.
    pub matches_cpu: bool,
    /// First differing byte, when it does not.
    pub first_difference: Option<usize>,
}

/// The GPU run.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceReport {
    /// The GPU's name.
    pub device: String,
    /// Device-to-device copy of one plain buffer, GB/s.
    pub memcpy_gbps: f64,
    /// Each kernel.
    pub kernels: Vec<DeviceKernel>,
}

/// Why the kernels did not run on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No driver library: nothing of cudarc's driver API was touched.
    #[error(transparent)]
    NoDriver(#[from] DriverMissing),
    /// The driver, the workload or a kernel failed.
    #[error(transparent)]
    Kernel(#[from] KernelError),
}

fn driver(op: &'static str) -> impl Fn(DriverError) -> KernelError {
    move |e| KernelError::Driver {
        op,
        message: format!("{e:?}"),
    }
}

/// Runs every case on GPU 0.
///
/// # Errors
/// [`DeviceError::NoDriver`] without `libcuda`; [`DeviceError::Kernel`] when the driver fails
/// (no device, out of memory, a launch error) or the workload is unusable. A kernel whose output
/// differs from the CPU's is reported (`matches_cpu: false`), not an error.
pub fn run(compiled: &[CompiledKernel], o: &DeviceOptions) -> Result<DeviceReport, DeviceError> {
    probe_driver()?;
    let w = o.workload;
    w.validate()?;
    let ctx = CudaContext::new(0).map_err(driver("creating a context on device 0"))?;
    let device = ctx.name().map_err(driver("cuDeviceGetName"))?;
    let stream = ctx.default_stream();
    let mut modules: BTreeMap<&str, Arc<CudaModule>> = BTreeMap::new();
    for k in compiled {
        let module = ctx
            .load_module(Ptx::from_src(k.ptx.clone()))
            .map_err(driver("cuModuleLoadData"))?;
        modules.insert(k.name, module);
    }
    let rounds = o.rounds.max(1);

    let plain = w.buffer_bytes()?;
    let mut host = vec![0u8; plain];
    fill_random(&mut host, o.seed);
    let src = stream.clone_htod(&host).map_err(driver("copy to device"))?;
    let mut dst = stream
        .alloc_zeros::<u8>(plain)
        .map_err(driver("cuMemAlloc"))?;
    let memcpy_ms = timed(&stream, rounds, |s| {
        s.memcpy_dtod(&src, &mut dst)
            .map_err(driver("cuMemcpyDtoD"))
    })?;
    let memcpy_gbps = plain as f64 / (memcpy_ms / 1e3) / 1e9;

    let mut kernels = Vec::new();
    for case in Case::all() {
        kernels.push(run_case(&stream, &modules, &w, case, o, rounds)?);
    }
    Ok(DeviceReport {
        device,
        memcpy_gbps,
        kernels,
    })
}

/// Mean milliseconds of `launch` over `rounds` launches, after one untimed.
fn timed(
    stream: &Arc<CudaStream>,
    rounds: usize,
    mut launch: impl FnMut(&Arc<CudaStream>) -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    launch(stream)?;
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream
        .record_event(flags)
        .map_err(driver("cuEventRecord"))?;
    for _ in 0..rounds {
        launch(stream)?;
    }
    let end = stream
        .record_event(flags)
        .map_err(driver("cuEventRecord"))?;
    let ms = start
        .elapsed_ms(&end)
        .map_err(driver("cuEventElapsedTime"))?;
    Ok(f64::from(ms) / rounds as f64)
}

fn run_case(
    stream: &Arc<CudaStream>,
    modules: &BTreeMap<&str, Arc<CudaModule>>,
    w: &Workload,
    case: Case,
    o: &DeviceOptions,
    rounds: usize,
) -> Result<DeviceKernel, KernelError> {
    let (input_lens, out_len) = w.sizes(case)?;
    let host_inputs: Vec<Vec<u8>> = input_lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let mut b = vec![0u8; len];
            fill_random(&mut b, o.seed.wrapping_add(17 + i as u64));
            b
        })
        .collect();
    let refs: Vec<&[u8]> = host_inputs.iter().map(Vec::as_slice).collect();
    let mut expected = vec![0u8; out_len];
    w.run_cpu(case, &refs, &mut expected, o.threads.max(1))?;

    let inputs = host_inputs
        .iter()
        .map(|b| stream.clone_htod(b))
        .collect::<Result<Vec<CudaSlice<u8>>, _>>()
        .map_err(driver("copy to device"))?;
    // Filled with a pattern no kernel writes everywhere, so an unwritten byte shows.
    let mut out = stream
        .clone_htod(&vec![0xA5u8; out_len])
        .map_err(driver("copy to device"))?;

    let plan = plan(w, case)?;
    let functions = plan
        .launches
        .iter()
        .map(|l| {
            let module = modules.get(l.module).ok_or(KernelError::Driver {
                op: "finding a module",
                message: format!("{} was not compiled", l.module),
            })?;
            module
                .load_function(&l.entry)
                .map_err(driver("cuModuleGetFunction"))
        })
        .collect::<Result<Vec<CudaFunction>, KernelError>>()?;
    // A grid-stride loop over the output's words; a gather's launches each cover one share.
    let total_words = out_len / plan.word / plan.launches.len().max(1);
    let threads_per_block = 256u32;
    let cfg = LaunchConfig {
        grid_dim: (
            total_words
                .div_ceil(threads_per_block as usize)
                .clamp(1, 1 << 19) as u32,
            1,
            1,
        ),
        block_dim: (threads_per_block, 1, 1),
        shared_mem_bytes: 0,
    };
    let ms = timed(stream, rounds, |s| {
        for (launch, f) in plan.launches.iter().zip(&functions) {
            let mut b = s.launch_builder(f);
            b.arg(&inputs[launch.input]).arg(&mut out);
            for arg in &launch.args {
                match arg {
                    Arg::U64(v) => b.arg(v),
                    Arg::I32(v) => b.arg(v),
                };
            }
            // SAFETY: `plan` gives each entry its parameters in order: two device pointers
            // (`const T*` source, `T*` destination; `T` the plan's word, which divides every
            // row, and cudaMalloc aligns to 256 bytes) then the u64 and int scalars of the
            // kernel's signature in `source.rs`. The buffers have the lengths
            // `Workload::sizes` gives for the case, which are the extents the kernels index
            // within for those scalars; the same plan and sizes are checked against the CPU
            // kernels by running the CUDA C as C++ in the tests.
            unsafe { b.launch(cfg) }.map_err(driver("cuLaunchKernel"))?;
        }
        Ok(())
    })?;
    let got = stream.clone_dtoh(&out).map_err(driver("copy to host"))?;
    let first_difference = got.iter().zip(&expected).position(|(a, b)| a != b);
    Ok(DeviceKernel {
        name: case.name(),
        gbps: out_len as f64 / (ms / 1e3) / 1e9,
        matches_cpu: first_difference.is_none() && got.len() == expected.len(),
        first_difference,
    })
}
