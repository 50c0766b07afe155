#pragma once

// The CUDA kernels of the training demo's GPU form (mlp_kernels.cu), behind plain C++ launchers so
// that mlp_gpu.cpp needs no CUDA header. Built only with CUDA (CONSORT_WITH_CUDA).
//
// Every launcher queues its kernels on `stream` (an opaque cudaStream_t of GPU `device`, which is
// made current for the launch and restored after it) and returns without waiting. The return value
// is nullptr when the launch was accepted, else CUDA's text for why not; errors of the execution
// surface at the stream's next synchronisation. Matrices are row-major float32 in device memory.
//
// Each output element of the tiled GEMM, the column sums and the batch totals is a sum in one
// fixed order (k = 0, 1, ... for the GEMM, row by row for the column sums, a fixed tree for the
// totals), so the same inputs give the same bytes on every run. `gemm` runs cuBLAS instead where
// it can be loaded (faster; the same bytes on every run of one GPU model and cuBLAS version, but
// cuBLAS may pick another algorithm for another M, so rows split differently may round
// differently); CONSORT_CUBLAS=off, or `gemm_tiled`, keeps the tiled kernel.

#include <cstdint>

namespace consort::train::kernels {

/// C[m, n] = sum_k op(A)[m, k] * op(B)[k, n], then, in this order, `+ bias[n]` (bias non-null),
/// max(0, .) (relu), `* (mask[m, n] > 0)` (mask non-null; an [M, N] matrix). op(A) is A [M, K], or
/// A^T for A stored [K, M] when `transpose_a`; op(B) is B [K, N], or B^T for B stored [N, K] when
/// `transpose_b`. K = 0 writes the epilogue of 0; M = 0 or N = 0 queues nothing.
const char* gemm(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m, int64_t n,
                 int64_t k, const float* a, const float* b, float* c, const float* bias, bool relu,
                 const float* mask);

/// `gemm` on our tiled kernel (64 x 64 tiles of C, k in order for every output).
const char* gemm_tiled(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m,
                       int64_t n, int64_t k, const float* a, const float* b, float* c,
                       const float* bias, bool relu, const float* mask);

/// `gemm` on cuBLAS (cublasSgemm, float32 arithmetic, then the epilogue as one more kernel); K = 0
/// goes to the tiled kernel. Returns why not, without launching, when cuBLAS is not loaded.
const char* gemm_cublas(int device, void* stream, bool transpose_a, bool transpose_b, int64_t m,
                        int64_t n, int64_t k, const float* a, const float* b, float* c,
                        const float* bias, bool relu, const float* mask);

/// Whether `gemm` hands an M x N x K product to cuBLAS: when cuBLAS is loaded and M, N and K are
/// all at least 64 (thinner products stay on the tiled kernel, faster there).
bool gemm_uses_cublas(int64_t m, int64_t n, int64_t k);

/// What `gemm` runs, for the demo's banner: "cuBLAS (libcublas.so.13) where every extent is at
/// least 64, the tiled kernel below", or "consort's tiled kernel (no cuBLAS: <why>)". cuBLAS is
/// libcublas.so.<the CUDA major version of the build>, loaded on first use; the environment's
/// CONSORT_CUBLAS=off keeps the tiled kernel, and CONSORT_CUBLAS=PATH loads that file instead.
const char* gemm_backend();

/// sums[c] = sum over rows r (in order) of a[r, c] for an [rows, cols] matrix; 0 when rows is 0.
const char* column_sums(int device, void* stream, int64_t rows, int64_t cols, const float* a,
                        float* sums);

/// Softmax cross-entropy of each row of `logits` [rows, classes] against `labels` [rows], in
/// float64 with a stable log-sum-exp: delta[r, k] = softmax(logits)[r, k] - (k == label) (float32),
/// and the batch totals written to `totals`: {sum of the rows' losses, rows whose first highest
/// logit is the label, rows}, as float32. A label outside [0, classes) makes its row's loss NaN
/// (so the loss reported for the step is NaN) and its delta 0. `scratch` holds 2 * rows doubles.
const char* softmax_cross_entropy(int device, void* stream, int64_t rows, int classes,
                                  const float* logits, const int32_t* labels, float* delta,
                                  double* scratch, float* totals);

} // namespace consort::train::kernels
