//! The CUDA C sources, one per kernel family.
//!
//! Each family is instantiated for five word sizes (1, 2, 4, 8 and 16 bytes: `_u8` … `_u128`);
//! the host picks the widest word that divides a row (`head_dim × dtype_bytes`), so a bf16 row of
//! 128 elements moves as sixteen 16-byte words. Every kernel is a grid-stride loop over the
//! destination's words, reading the source word the layout maps it to: the same index
//! arithmetic as the CPU kernels, written out element by element.

/// Word types and the instantiating macro shared by every source.
pub(crate) const PRELUDE: &str = r#"
typedef unsigned long long u64;
typedef unsigned char kvh_w1;
typedef unsigned short kvh_w2;
typedef unsigned int kvh_w4;
typedef unsigned long long kvh_w8;
struct __align__(16) kvh_w16 { unsigned int x, y, z, w; };
#define KVH_INSTANTIATE(FAMILY) \
    FAMILY(u8, kvh_w1) \
    FAMILY(u16, kvh_w2) \
    FAMILY(u32, kvh_w4) \
    FAMILY(u64, kvh_w8) \
    FAMILY(u128, kvh_w16)
#define KVH_GRID_STRIDE(i, total) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (u64)gridDim.x * blockDim.x)
"#;

/// NHD ↔ HND. Destination row `o·inner + i` of a block is source row `i·outer + o`, where
/// `outer` is the destination's outer dimension (heads when `to_hnd`, tokens otherwise).
const PERMUTE: &str = r#"
#define KVH_PERMUTE(W, T) \
extern "C" __global__ void kvh_permute_##W( \
    const T* __restrict__ src, T* __restrict__ dst, \
    u64 blocks, u64 tokens, u64 heads, u64 row_words, int to_hnd) \
{ \
    const u64 per_block = tokens * heads * row_words; \
    const u64 outer = to_hnd ? heads : tokens; \
    const u64 inner = to_hnd ? tokens : heads; \
    KVH_GRID_STRIDE(i, blocks * per_block) { \
        const u64 b = i / per_block, r = i % per_block; \
        const u64 w = r % row_words, row = r / row_words; \
        const u64 o = row / inner, n = row % inner; \
        dst[i] = src[b * per_block + (n * outer + o) * row_words + w]; \
    } \
}
KVH_INSTANTIATE(KVH_PERMUTE)
"#;

/// Kernel block size. Gather: large block `b` takes sub-blocks `b·ratio + j`; its token
/// `t = j·B + s` is token `s` of sub-block `j`, zero past the `n_sub` sub-blocks there are.
/// Split: the inverse, over the sub-blocks.
const REGROUP: &str = r#"
#define KVH_REGROUP(W, T) \
extern "C" __global__ void kvh_regroup_gather_##W( \
    const T* __restrict__ src, T* __restrict__ dst, \
    u64 n_sub, u64 big_blocks, u64 sub_tokens, u64 heads, u64 row_words, u64 ratio, int hnd) \
{ \
    const u64 big_tokens = sub_tokens * ratio; \
    const u64 per_big = big_tokens * heads * row_words; \
    const u64 per_sub = sub_tokens * heads * row_words; \
    KVH_GRID_STRIDE(i, big_blocks * per_big) { \
        const u64 b = i / per_big, r = i % per_big; \
        const u64 w = r % row_words, row = r / row_words; \
        const u64 h = hnd ? row / big_tokens : row % heads; \
        const u64 t = hnd ? row % big_tokens : row / heads; \
        const u64 s = b * ratio + t / sub_tokens, st = t % sub_tokens; \
        if (s < n_sub) { \
            const u64 from = hnd ? h * sub_tokens + st : st * heads + h; \
            dst[i] = src[s * per_sub + from * row_words + w]; \
        } else { \
            dst[i] = T(); \
        } \
    } \
} \
extern "C" __global__ void kvh_regroup_split_##W( \
    const T* __restrict__ src, T* __restrict__ dst, \
    u64 n_sub, u64 sub_tokens, u64 heads, u64 row_words, u64 ratio, int hnd) \
{ \
    const u64 big_tokens = sub_tokens * ratio; \
    const u64 per_big = big_tokens * heads * row_words; \
    const u64 per_sub = sub_tokens * heads * row_words; \
    KVH_GRID_STRIDE(i, n_sub * per_sub) { \
        const u64 s = i / per_sub, r = i % per_sub; \
        const u64 w = r % row_words, row = r / row_words; \
        const u64 h = hnd ? row / sub_tokens : row % heads; \
        const u64 st = hnd ? row % sub_tokens : row / heads; \
        const u64 b = s / ratio, t = (s % ratio) * sub_tokens + st; \
        const u64 from = hnd ? h * big_tokens + t : t * heads + h; \
        dst[i] = src[b * per_big + from * row_words + w]; \
    } \
}
KVH_INSTANTIATE(KVH_REGROUP)
"#;

/// Heads `[src_h0, src_h0 + count)` of each source block into heads `[dst_h0, dst_h0 + count)`
/// of each destination block. A slice is one launch (`dst_h0 = 0`); a gather one launch per
/// source (`src_h0 = 0`, `dst_h0 = i·heads`).
const HEADS: &str = r#"
#define KVH_HEADS(W, T) \
extern "C" __global__ void kvh_copy_heads_##W( \
    const T* __restrict__ src, T* __restrict__ dst, \
    u64 blocks, u64 tokens, u64 src_heads, u64 src_h0, u64 dst_heads, u64 dst_h0, \
    u64 count, u64 row_words, int hnd) \
{ \
    KVH_GRID_STRIDE(i, blocks * tokens * count * row_words) { \
        const u64 w = i % row_words; \
        u64 q = i / row_words; \
        u64 t, hh, b; \
        if (hnd) { t = q % tokens; q /= tokens; hh = q % count; b = q / count; } \
        else { hh = q % count; q /= count; t = q % tokens; b = q / tokens; } \
        const u64 from = hnd ? (src_h0 + hh) * tokens + t : t * src_heads + src_h0 + hh; \
        const u64 to = hnd ? (dst_h0 + hh) * tokens + t : t * dst_heads + dst_h0 + hh; \
        dst[(b * tokens * dst_heads + to) * row_words + w] = \
            src[(b * tokens * src_heads + from) * row_words + w]; \
    } \
}
KVH_INSTANTIATE(KVH_HEADS)
"#;

/// Word-size suffixes of every instantiated kernel, with their sizes in bytes.
pub const WORDS: [(&str, usize); 5] = [("u8", 1), ("u16", 2), ("u32", 4), ("u64", 8), ("u128", 16)];

/// One CUDA source: its name, text (without the prelude) and the kernel families it defines.
pub struct CudaSource {
    /// Name of the source (the program name given to NVRTC).
    pub name: &'static str,
    /// CUDA C text, compiled after the shared prelude (word types, the instantiating macro).
    pub body: &'static str,
    /// The `extern "C"` kernels it defines, without their word suffix.
    pub families: &'static [&'static str],
}

impl CudaSource {
    /// The whole translation unit NVRTC compiles.
    pub fn text(&self) -> String {
        format!("{PRELUDE}{}", self.body)
    }

    /// Every kernel entry the PTX must contain.
    pub fn entries(&self) -> Vec<String> {
        self.families
            .iter()
            .flat_map(|f| WORDS.iter().map(move |(w, _)| format!("{f}_{w}")))
            .collect()
    }
}

/// Every CUDA source of the crate.
pub const SOURCES: [CudaSource; 3] = [
    CudaSource {
        name: "kvh_permute",
        body: PERMUTE,
        families: &["kvh_permute"],
    },
    CudaSource {
        name: "kvh_regroup",
        body: REGROUP,
        families: &["kvh_regroup_gather", "kvh_regroup_split"],
    },
    CudaSource {
        name: "kvh_heads",
        body: HEADS,
        families: &["kvh_copy_heads"],
    },
];
