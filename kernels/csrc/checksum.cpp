// zlightning::block_checksums: the swap files' per-block checksums in one pass over memory.
//
// [Note: the checksum in one pass]
// A swap block's checksum (zlightning/zero/_swap_io.py, `block_checksum`) is the pair of wrapping 64-bit sums
// (sum w_i, sum (i + 1) w_i) over its 8-byte words. The PyTorch reference forms it from two reductions of the block
// viewed as a matrix (row sums and column sums): two passes over memory, for data that was just written or read by
// the disk and sits in no cache. Here one pass keeps Fletcher's running sums in four interleaved lanes (word
// i = 4k + j goes to lane j): a_j = sum_k w, b_j = sum_k (m - k) w after the lane's m words, so
// sum_k k w = m a_j - b_j, and sum (i + 1) w_i = sum_j (4 (m a_j - b_j) + (j + 1) a_j) plus the tail words
// (fewer than four) added directly. Unsigned arithmetic wraps modulo 2**64 exactly as the reference's int64 sums
// do, so both give the same value for every block (tested bit for bit). The four independent lanes let the
// compiler keep them in vector registers; the loop runs at memory bandwidth.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace zl {
namespace {

void checksum_words(const uint64_t* w, int64_t n, uint64_t* plain, uint64_t* weighted) {
  constexpr int kLanes = 4;
  const int64_t m = n / kLanes;
  uint64_t a[kLanes] = {0, 0, 0, 0};
  uint64_t b[kLanes] = {0, 0, 0, 0};
  for (int64_t k = 0; k < m; ++k) {
    for (int j = 0; j < kLanes; ++j) {
      a[j] += w[k * kLanes + j];
      b[j] += a[j];
    }
  }
  uint64_t p = 0;
  uint64_t q = 0;
  const auto um = static_cast<uint64_t>(m);
  for (int j = 0; j < kLanes; ++j) {
    p += a[j];
    q += kLanes * (um * a[j] - b[j]) + static_cast<uint64_t>(j + 1) * a[j];
  }
  for (int64_t i = m * kLanes; i < n; ++i) {
    p += w[i];
    q += static_cast<uint64_t>(i + 1) * w[i];
  }
  *plain = p;
  *weighted = q;
}

// Checksums of consecutive `block_size`-byte blocks of `data` (the last one may be shorter); every block's length
// must be a multiple of 8 bytes. Returns int64 [blocks, 2]: (plain, weighted), as two's-complement of the sums.
at::Tensor block_checksums(const at::Tensor& data, int64_t block_size) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == at::kByte,
              "zlightning::block_checksums: needs a contiguous CPU uint8 tensor, got ", data.scalar_type(), " on ",
              data.device());
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0, "zlightning::block_checksums: block_size must be a positive "
              "multiple of 8, got ", block_size);
  const int64_t n = data.numel();
  TORCH_CHECK(n % 8 == 0, "zlightning::block_checksums: ", n, " bytes is not a whole number of 8-byte words");
  const int64_t blocks = (n + block_size - 1) / block_size;
  at::Tensor out = at::empty({blocks, 2}, at::TensorOptions().dtype(at::kLong));
  auto* dst = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  const auto* base = data.data_ptr<uint8_t>();
  const bool aligned = reinterpret_cast<uintptr_t>(base) % alignof(uint64_t) == 0;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t start = i * block_size;
    const int64_t len = std::min(block_size, n - start);
    if (aligned) {
      checksum_words(reinterpret_cast<const uint64_t*>(base + start), len / 8, dst + 2 * i, dst + 2 * i + 1);
    } else {  // a view at an odd offset: copy word by word (never the case for the swap pool's aligned buffers)
      at::Tensor words = at::empty({len / 8}, at::TensorOptions().dtype(at::kLong));
      std::memcpy(words.data_ptr<int64_t>(), base + start, len);
      checksum_words(reinterpret_cast<const uint64_t*>(words.data_ptr<int64_t>()), len / 8, dst + 2 * i,
                     dst + 2 * i + 1);
    }
  }
  return out;
}

}  // namespace
}  // namespace zl

TORCH_LIBRARY_FRAGMENT(zlightning, m) { m.def("block_checksums(Tensor data, int block_size) -> Tensor"); }

TORCH_LIBRARY_IMPL(zlightning, CPU, m) { m.impl("block_checksums", &zl::block_checksums); }
