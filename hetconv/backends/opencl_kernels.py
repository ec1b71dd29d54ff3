"""The OpenCL kernels of the opencl backend (:mod:`.opencl`): their source, the work-group
tilings they are built with, and the launch arithmetic that depends only on the tiling.

Each of the three operations is one matrix product whose second operand is the lowered
(im2col) input, but the lowering is never written out: a work-group stages a TK-deep slice of
both operands in local memory, reading the input through the im2col index arithmetic (zero
outside the image, so padding costs no copy), and every work-item accumulates a WM x WN block
of outputs in registers (the register-blocked SGEMM of Nugteren's "myGEMM" tutorial, kernel 6).

=============  ===========  =================  =====================  ====================
operation      rows (M)     columns            depth (summed over)    lowered operand
=============  ===========  =================  =====================  ====================
forward        K kernels    N*Ho*Wo positions  C*kh*kw taps           input, im2col
grad input     C channels   N*H*W pixels       K*kh*kw taps           output grad, "full"
grad kernels   K kernels    C*kh*kw taps       N*Ho*Wo positions      input, im2col
=============  ===========  =================  =====================  ====================

The input gradient is a "full" correlation of the output gradient with the flipped kernels,
so it gathers (no col2im scatter, no atomics). The kernel gradient has few outputs and a long
sum; it is split over the depth (split-K) until the device has enough work-groups, and the
slices are summed by a second kernel. The bias gradient is a work-group tree reduction.

Nothing here needs pyopencl: the source does not depend on the geometry, only on the tiling.
"""

from __future__ import annotations

from dataclasses import dataclass
from string import Template

from .base import ConvShape

# Split the kernel-gradient sum until there are this many work-groups per compute unit.
GROUPS_PER_COMPUTE_UNIT = 4
MAX_SLICES = 64


@dataclass(frozen=True)
class Tiling:
    """Work-group shape of the GEMM kernels: an RN x RM grid of work-items, each computing
    WM x WN outputs, so a work-group computes a (RM*WM) x (RN*WN) tile, TK terms at a time."""

    rm: int
    rn: int
    wm: int
    wn: int
    tk: int

    def __post_init__(self) -> None:
        # The tile loaders give every work-item the same number of values of each operand.
        items = self.items
        if items % self.tk or items % self.tile_n or (self.tile_m * self.tk) % items:
            raise ValueError(f"{self} does not split its tiles evenly over {items} work-items")

    @property
    def tile_m(self) -> int:
        return self.rm * self.wm

    @property
    def tile_n(self) -> int:
        return self.rn * self.wn

    @property
    def items(self) -> int:
        return self.rm * self.rn

    @property
    def reduce_group(self) -> int:
        """Work-items of the bias-gradient reduction (a power of two)."""
        return min(64, 1 << (self.items.bit_length() - 1))

    @property
    def local_bytes(self) -> int:
        return 4 * self.tk * (self.tile_m + self.tile_n + 2)

    def defines(self) -> list[str]:
        return [
            f"-DRM={self.rm}",
            f"-DRN={self.rn}",
            f"-DWM={self.wm}",
            f"-DWN={self.wn}",
            f"-DTK={self.tk}",
            f"-DREDUCE_GROUP={self.reduce_group}",
        ]

    def gemm_ndrange(self, rows: int, cols: int, slices: int) -> tuple[tuple[int, ...], ...]:
        """(global size, local size) of a GEMM kernel over ``rows`` x ``cols`` outputs in
        ``slices`` depth slices: one work-group per output tile and slice."""
        groups = (-(-cols // self.tile_n), -(-rows // self.tile_m), slices)
        return (groups[0] * self.rn, groups[1] * self.rm, slices), (self.rn, self.rm, 1)


# 64 x 64 tiles. GPUs: 256 work-items of 4 x 4 outputs (occupancy, few registers each). CPUs:
# 64 work-items of 8 x 8 (PoCL keeps per-work-item state in memory across barriers, so fewer,
# fatter work-items win: 5.4 vs 4.0 GFLOPS on the C2 forward here). Smaller ones are fallbacks
# for devices whose work-groups or registers do not allow these.
GPU_TILING = Tiling(16, 16, 4, 4, 16)
CPU_TILING = Tiling(8, 8, 8, 8, 16)
FALLBACK_TILINGS = (Tiling(8, 8, 4, 4, 16), Tiling(4, 4, 4, 4, 16))


def tilings(kind: str) -> tuple[Tiling, ...]:
    """Tilings to try for a device of ``kind``, best first."""
    first = (CPU_TILING, GPU_TILING) if kind == "cpu" else (GPU_TILING, CPU_TILING)
    return first + FALLBACK_TILINGS


# ----------------------------------------------------------------------------- kernel source

GEMM_TEMPLATE = Template(
    r"""
__kernel __attribute__((reqd_work_group_size(RN, RM, 1)))
void $name($buffers,
           const int N, const int C, const int H, const int W, const int K,
           const int KH, const int KW, const int PT, const int PL,
           const int HO, const int WO, const int k_slice)
{
    const int KK = KH * KW, HW = H * W, P = HO * WO;
    $sizes
    const int lx = get_local_id(0), ly = get_local_id(1);
    const int tid = ly * RN + lx;
    const int row0 = get_group_id(1) * TILE_M;
    const int col0 = get_group_id(0) * TILE_N;
    const int k_begin = get_group_id(2) * k_slice;
    const int k_end = min(k_begin + k_slice, DEPTH);

    __local float a_tile[TK][TILE_M + 1];
    __local float b_tile[TK][TILE_N + 1];

    /* Each work-item loads the same operand-B column on every step: decompose it once. */
    const int a_term = tid % TK, a_row = tid / TK;
    const int b_tile_col = tid % TILE_N, b_term = tid / TILE_N;
    const int b_col = col0 + b_tile_col;
    const bool b_col_ok = b_col < COLS;
    $b_setup

    float acc[WM][WN];
    #pragma unroll
    for (int i = 0; i < WM; i++) {
        #pragma unroll
        for (int j = 0; j < WN; j++) acc[i][j] = 0.0f;
    }

    for (int k0 = k_begin; k0 < k_end; k0 += TK) {
        #pragma unroll
        for (int q = 0; q < TILE_M * TK / (RM * RN); q++) {
            const int r = a_row + q * (RM * RN / TK);
            const int row = row0 + r, t = k0 + a_term;
            float v = 0.0f;
            if (row < ROWS && t < k_end) { $a_load }
            a_tile[a_term][r] = v;
        }
        #pragma unroll
        for (int q = 0; q < TILE_N * TK / (RM * RN); q++) {
            const int tt = b_term + q * (RM * RN / TILE_N);
            const int t = k0 + tt;
            float v = 0.0f;
            if (b_col_ok && t < k_end) { $b_load }
            b_tile[tt][b_tile_col] = v;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        #pragma unroll
        for (int t = 0; t < TK; t++) {
            float a[WM], b[WN];
            #pragma unroll
            for (int i = 0; i < WM; i++) a[i] = a_tile[t][ly + i * RM];
            #pragma unroll
            for (int j = 0; j < WN; j++) b[j] = b_tile[t][lx + j * RN];
            #pragma unroll
            for (int i = 0; i < WM; i++) {
                #pragma unroll
                for (int j = 0; j < WN; j++) acc[i][j] += a[i] * b[j];
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    #pragma unroll
    for (int i = 0; i < WM; i++) {
        const int row = row0 + ly + i * RM;
        #pragma unroll
        for (int j = 0; j < WN; j++) {
            const int col = col0 + lx + j * RN;
            if (row < ROWS && col < COLS) { $store }
        }
    }
}
"""
)

# Forward: y[n,k,oy,ox] = sum_{c,i,j} w[k,c,i,j] * x[n,c,oy+i-PT,ox+j-PL].
FORWARD = {
    "name": "conv_forward",
    "buffers": "__global const float *restrict x, __global const float *restrict w, "
    "__global const float *restrict bias, __global float *restrict y, const int has_bias",
    "sizes": "const int ROWS = K, COLS = N * P, DEPTH = C * KK;",
    "b_setup": """
    const int b_n = b_col / P, b_p = b_col - b_n * P;
    const int b_oy = b_p / WO, b_ox = b_p - b_oy * WO;
    const int b_y0 = b_oy - PT, b_x0 = b_ox - PL;
    const int b_base = b_n * C * HW;""",
    "a_load": "v = w[row * DEPTH + t];",
    "b_load": """
                const int c = t / KK, ij = t - c * KK, i = ij / KW, j = ij - i * KW;
                const int yy = b_y0 + i, xx = b_x0 + j;
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = x[b_base + c * HW + yy * W + xx];""",
    "store": """
                const int n = col / P, p = col - n * P;
                y[(n * K + row) * P + p] = acc[i][j] + (has_bias ? bias[row] : 0.0f);""",
}

# Input gradient: dx[n,c,y,x] = sum_{k,i,j} w[k,c,i,j] * dy[n,k,y+PT-i,x+PL-j] (in range).
GRAD_INPUT = {
    "name": "conv_grad_input",
    "buffers": "__global const float *restrict dy, __global const float *restrict w, "
    "__global float *restrict dx",
    "sizes": "const int ROWS = C, COLS = N * HW, DEPTH = K * KK;",
    "b_setup": """
    const int b_n = b_col / HW, b_rest = b_col - b_n * HW;
    const int b_y = b_rest / W, b_x = b_rest - b_y * W;
    const int b_y0 = b_y + PT, b_x0 = b_x + PL;
    const int b_base = b_n * K * P;""",
    "a_load": "const int k = t / KK; v = w[(k * C + row) * KK + (t - k * KK)];",
    "b_load": """
                const int k = t / KK, ij = t - k * KK, i = ij / KW, j = ij - i * KW;
                const int oy = b_y0 - i, ox = b_x0 - j;
                if (oy >= 0 && oy < HO && ox >= 0 && ox < WO)
                    v = dy[b_base + k * P + oy * WO + ox];""",
    "store": """
                const int n = col / HW;
                dx[(n * C + row) * HW + (col - n * HW)] = acc[i][j];""",
}

# Kernel gradient: dw[k,c,i,j] = sum_{n,oy,ox} dy[n,k,oy,ox] * x[n,c,oy+i-PT,ox+j-PL], written
# as slice get_group_id(2) of the depth into partial[slice, k, c*kh*kw].
GRAD_KERNELS = {
    "name": "conv_grad_kernels",
    "buffers": "__global const float *restrict x, __global const float *restrict dy, "
    "__global float *restrict partial",
    "sizes": "const int ROWS = K, COLS = C * KK, DEPTH = N * P;",
    "b_setup": """
    const int b_c = b_col / KK, b_ij = b_col - b_c * KK;
    const int b_i = b_ij / KW, b_j = b_ij - b_i * KW;
    const int b_base = b_c * HW, b_dy = b_i - PT, b_dx = b_j - PL;""",
    "a_load": "const int n = t / P; v = dy[(n * K + row) * P + (t - n * P)];",
    "b_load": """
                const int n = t / P, p = t - n * P, oy = p / WO, ox = p - oy * WO;
                const int yy = oy + b_dy, xx = ox + b_dx;
                if (yy >= 0 && yy < H && xx >= 0 && xx < W)
                    v = x[n * C * HW + b_base + yy * W + xx];""",
    "store": """
                partial[(get_group_id(2) * ROWS + row) * COLS + col] = acc[i][j];""",
}

REDUCTIONS = r"""
/* out[e] = sum over slices s of partial[s, e]. */
__kernel void sum_slices(__global const float *restrict partial, __global float *restrict out,
                         const int slices, const int size)
{
    const int e = get_global_id(0);
    if (e >= size) return;
    float s = 0.0f;
    for (int z = 0; z < slices; z++) s += partial[z * size + e];
    out[e] = s;
}

/* db[k] = sum over n, p of dy[n, k, p]: one work-group per kernel, a tree in local memory. */
__kernel __attribute__((reqd_work_group_size(REDUCE_GROUP, 1, 1)))
void bias_grad(__global const float *restrict dy, __global float *restrict db,
               const int N, const int K, const int P)
{
    const int k = get_group_id(0), lid = get_local_id(0);
    __local float part[REDUCE_GROUP];
    float s = 0.0f;
    for (int n = 0; n < N; n++)
        for (int p = lid; p < P; p += REDUCE_GROUP) s += dy[(n * K + k) * P + p];
    part[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int step = REDUCE_GROUP / 2; step > 0; step /= 2) {
        if (lid < step) part[lid] += part[lid + step];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) db[k] = part[0];
}
"""


def program_source() -> str:
    """The OpenCL C source of all five kernels; the tiling comes as -D defines at build."""
    header = "#define TILE_M (RM * WM)\n#define TILE_N (RN * WN)\n"
    gemms = [GEMM_TEMPLATE.substitute(part) for part in (FORWARD, GRAD_INPUT, GRAD_KERNELS)]
    return header + "".join(gemms) + REDUCTIONS


KERNEL_NAMES = ("conv_forward", "conv_grad_input", "conv_grad_kernels", "sum_slices", "bias_grad")


def grad_kernel_split(shape: ConvShape, tiling: Tiling, compute_units: int) -> tuple[int, int]:
    """(slices, terms per slice) of the kernel gradient's depth N*Ho*Wo (split-K): enough
    work-groups to fill ``compute_units``, each slice at least 8 depth tiles."""
    t = tiling
    ho, wo = shape.out_hw
    depth = shape.n * ho * wo
    groups = -(-shape.k // t.tile_m) * -(-(shape.c * shape.kh * shape.kw) // t.tile_n)
    wanted = -(-GROUPS_PER_COMPUTE_UNIT * compute_units // groups)
    slices = max(1, min(wanted, MAX_SLICES, depth // (8 * t.tk)))
    k_slice = -(-depth // slices)
    k_slice = -(-k_slice // t.tk) * t.tk
    return -(-depth // k_slice), k_slice
