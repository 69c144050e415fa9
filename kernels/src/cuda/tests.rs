//! NVRTC compiles every CUDA kernel to PTX. In CI (`CI` set) NVRTC must be there: the test
//! fails without it, as the NIXL tests do. Locally a missing NVRTC skips with a message.

use super::*;

/// NVRTC, or `None` (after saying why) when it is missing outside CI.
fn nvrtc_or_skip(test: &str) -> Option<()> {
    match probe_nvrtc() {
        Ok(()) => Some(()),
        Err(e) if std::env::var_os("CI").is_some() => {
            panic!("{test}: NVRTC is required in CI: {e}")
        }
        Err(e) => {
            eprintln!(
                "SKIPPED {test}: {e} (scripts/test.sh installs nvidia-cuda-nvrtc-cu12 and \
                 sets LD_LIBRARY_PATH; in CI this test fails instead)"
            );
            None
        }
    }
}

#[test]
fn every_cuda_kernel_compiles_to_ptx() {
    if nvrtc_or_skip("every_cuda_kernel_compiles_to_ptx").is_none() {
        return;
    }
    let (major, minor) = nvrtc_version().unwrap();
    let compiled = compile_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(compiled.len(), SOURCES.len());
    let mut entries = 0;
    for (k, source) in compiled.iter().zip(SOURCES.iter()) {
        assert_eq!(k.name, source.name);
        assert!(k.ptx.contains(".version"), "{} is not PTX", k.name);
        for entry in source.entries() {
            assert!(k.ptx.contains(&format!(".entry {entry}(")), "{entry}");
        }
        entries += k.entries.len();
        eprintln!(
            "{}: {} bytes of PTX, {} entries",
            k.name,
            k.ptx.len(),
            k.entries.len()
        );
    }
    // permute, regroup gather and split, copy heads: four families at five word sizes.
    assert_eq!(entries, 20);
    eprintln!("NVRTC {major}.{minor}: {entries} kernels compiled to PTX");
}

/// A source NVRTC refuses is a typed error carrying NVRTC's log, not a panic.
#[test]
fn a_broken_source_is_a_compile_error() {
    if nvrtc_or_skip("a_broken_source_is_a_compile_error").is_none() {
        return;
    }
    let broken = CudaSource {
        name: "broken",
        body: "extern \"C\" __global__ void broken() { undeclared(); }",
        families: &[],
    };
    match compile(&broken) {
        Err(KernelError::Compile { kernel, log }) => {
            assert_eq!(kernel, "broken");
            assert!(log.contains("undeclared"), "{log}");
        }
        other => panic!("{other:?}"),
    }
}

/// Without a driver (this machine, CI) the GPU run says so, typed, without panicking; with one
/// it runs every kernel and each matches the CPU kernel.
#[test]
fn the_gpu_run_reports_a_missing_driver_or_matches_the_cpu() {
    let options = device::DeviceOptions {
        workload: crate::bench::Workload {
            shape: crate::BlockShape::new(16, 8, 64, 2),
            blocks: 37,
            ratio: 4,
            tp_split: 2,
        },
        rounds: 2,
        seed: 9,
        threads: 1,
    };
    match probe_driver() {
        Err(DriverMissing) => {
            assert_eq!(
                device::run(&[], &options),
                Err(device::DeviceError::NoDriver(DriverMissing))
            );
            eprintln!("no CUDA driver here: the GPU run reports NoDriver");
        }
        Ok(()) => {
            if nvrtc_or_skip("the_gpu_run_reports_a_missing_driver_or_matches_the_cpu").is_none() {
                return;
            }
            let compiled = compile_all().unwrap();
            match device::run(&compiled, &options) {
                Ok(report) => {
                    for k in &report.kernels {
                        assert!(
                            k.matches_cpu,
                            "{} differs at {:?}",
                            k.name, k.first_difference
                        );
                    }
                }
                // A driver library without a usable GPU: no context on device 0.
                Err(device::DeviceError::Kernel(KernelError::Driver {
                    op: "creating a context on device 0",
                    message,
                })) => eprintln!("CUDA driver present but no usable GPU: {message}"),
                Err(e) => panic!("the GPU run failed: {e}"),
            }
        }
    }
}

/// The CUDA C of every kernel, compiled as C++ with g++ and run on the CPU (one emulated grid of
/// 3 blocks × 7 threads, each thread running its grid-stride loop), following the same launch
/// [`plan`] as [`device::run`], gives the CPU kernels' output for every case, at every word size.
/// This checks the kernels' index arithmetic and the plan's arguments where no GPU is lent.
#[test]
fn the_cuda_sources_run_as_cpp_match_the_cpu_kernels() {
    use crate::bench::{fill_random, Case, Workload};
    use crate::BlockShape;
    use std::process::Command;

    if Command::new("g++").arg("--version").output().is_err() {
        assert!(std::env::var_os("CI").is_none(), "g++ is required in CI");
        eprintln!("SKIPPED the_cuda_sources_run_as_cpp_match_the_cpu_kernels: no g++");
        return;
    }
    let workload = |tokens, heads, head_dim, dtype_bytes, blocks, ratio, tp_split| Workload {
        shape: BlockShape::new(tokens, heads, head_dim, dtype_bytes),
        blocks,
        ratio,
        tp_split,
    };
    // Rows of 128, 6, 5, 12 and 8 bytes: words of 16, 2, 1, 4 and 8 bytes.
    let workloads = [
        workload(16, 8, 64, 2, 37, 4, 2),
        workload(32, 2, 6, 1, 7, 3, 2),
        workload(16, 4, 5, 1, 5, 2, 4),
        workload(16, 2, 3, 4, 9, 4, 1),
        workload(16, 8, 1, 8, 3, 2, 8),
    ];
    let dir = std::env::temp_dir().join(format!("kvh-cuda-as-cpp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let word_type = |word: usize| format!("kvh_w{word}");

    let mut main = String::new();
    let mut expected = Vec::new();
    let mut words = std::collections::BTreeSet::new();
    for (wi, w) in workloads.iter().enumerate() {
        for (ci, case) in Case::all().into_iter().enumerate() {
            let id = format!("w{wi}c{ci}");
            let (input_lens, out_len) = w.sizes(case).unwrap();
            let inputs: Vec<Vec<u8>> = input_lens
                .iter()
                .enumerate()
                .map(|(i, &len)| {
                    let mut b = vec![0u8; len];
                    fill_random(&mut b, (wi * 100 + ci * 10 + i) as u64);
                    std::fs::write(dir.join(format!("{id}_in{i}.bin")), &b).unwrap();
                    b
                })
                .collect();
            let refs: Vec<&[u8]> = inputs.iter().map(Vec::as_slice).collect();
            let mut want = vec![0u8; out_len];
            w.run_cpu(case, &refs, &mut want, 1).unwrap();
            expected.push((id.clone(), case.name(), *w, want));

            let p = plan::plan(w, case).unwrap();
            words.insert(p.word);
            let t = word_type(p.word);
            main.push_str("  {\n    std::vector<std::vector<unsigned char>> in;\n");
            for i in 0..inputs.len() {
                main.push_str(&format!(
                    "    in.push_back(load(dir + \"/{id}_in{i}.bin\"));\n"
                ));
            }
            main.push_str(&format!(
                "    std::vector<unsigned char> out({out_len}, 0xA5);\n"
            ));
            for l in &p.launches {
                let args: Vec<String> = l
                    .args
                    .iter()
                    .map(|a| match a {
                        plan::Arg::U64(v) => format!("{v}ULL"),
                        plan::Arg::I32(v) => format!("{v}"),
                    })
                    .collect();
                main.push_str(&format!(
                    "    KVH_LAUNCH({}((const {t}*)in[{}].data(), ({t}*)out.data(), {}));\n",
                    l.entry,
                    l.input,
                    args.join(", ")
                ));
            }
            main.push_str(&format!("    save(dir + \"/{id}_out.bin\", out);\n  }}\n"));
        }
    }
    assert_eq!(words.len(), 5, "every word size is exercised: {words:?}");
    let bodies: String = SOURCES.iter().map(|s| s.body).collect();
    let sources = format!("{}{bodies}", source::PRELUDE);
    let cpp = format!(
        r#"#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>
struct kvh_dim3 {{ unsigned int x, y, z; }};
static kvh_dim3 blockIdx = {{0, 0, 0}}, threadIdx = {{0, 0, 0}};
static const kvh_dim3 blockDim = {{7, 1, 1}}, gridDim = {{3, 1, 1}};
#define __global__
#define __align__(n) alignas(n)
{sources}
static std::vector<unsigned char> load(const std::string& path) {{
    FILE* f = std::fopen(path.c_str(), "rb");
    if (!f) std::exit(2);
    std::fseek(f, 0, SEEK_END);
    long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<unsigned char> v(n);
    if (n > 0 && std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(3);
    std::fclose(f);
    return v;
}}
static void save(const std::string& path, const std::vector<unsigned char>& v) {{
    FILE* f = std::fopen(path.c_str(), "wb");
    if (!f || std::fwrite(v.data(), 1, v.size(), f) != v.size()) std::exit(4);
    std::fclose(f);
}}
#define KVH_LAUNCH(...) \
    for (unsigned b = 0; b < gridDim.x; ++b) \
        for (unsigned t = 0; t < blockDim.x; ++t) {{ \
            blockIdx.x = b; threadIdx.x = t; __VA_ARGS__; \
        }}
int main(int argc, char** argv) {{
  if (argc != 2) return 1;
  const std::string dir = argv[1];
{main}  return 0;
}}
"#
    );
    let src = dir.join("harness.cpp");
    let exe = dir.join("harness");
    std::fs::write(&src, cpp).unwrap();
    let built = Command::new("g++")
        .args(["-std=c++17", "-O1", "-Wall", "-Werror", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "g++: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let ran = Command::new(&exe).arg(&dir).status().unwrap();
    assert!(ran.success(), "the harness failed: {ran}");
    for (id, name, w, want) in &expected {
        let got = std::fs::read(dir.join(format!("{id}_out.bin"))).unwrap();
        let first = got.iter().zip(want).position(|(a, b)| a != b);
        assert!(
            got.len() == want.len() && first.is_none(),
            "{name} on {w:?}: the CUDA C differs from the CPU kernel at byte {first:?}"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
