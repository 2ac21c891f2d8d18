// A decode_layers step's LoRA adapters (decode_stack.h holds one; decode_layers.cpp's team
// calls it around each matmul): the op's lora_slots / lora_blobs / lora_index arguments
// checked against lora_rows.h's contract before anything runs, the adapter rows grouped slot
// by slot, and the two halves of a matmul's addition:
// - shrink: x A^T for every adapter row into `xa`, shared by the team. The (adapter, 16
//   ranks) chunks are dealt out in turn and the caller meets after: each thread computing
//   every rank read each A twice (3.7 ms a step of 16 rows over 4 rank-16 adapters, on both
//   threads, against ~2 for the halves and a barrier; docs/perf-log/2026-12-07-lora-layers.md).
//   With fewer chunks than two a thread (one row: o's and down's A are one chunk, qkv's three)
//   each chunk's inputs are split among the team too, a partial sum each, which the expand
//   adds up: one thread read a whole A while the other waited at the meeting.
// - expand: (x A^T) B^T added to the output columns of the panels a thread computed, a run of
//   consecutive panels at a time (a panel at a time, 32 columns, took 1.5x as long).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "lora_rows.h"
#include "vec_math.h"

namespace tritonserve_lora {

struct Shape {  // matmul i of the stack: input width, outputs, silu in its bf16 epilogue
  int64_t K, N;
  bool silu;
};

struct Step {
  std::vector<Proj> proj;  // projection i of slot s: proj[s * per + i]
  torch::Tensor slots;
  const int64_t* slot = nullptr;  // [M], -1: the base; null when no row has an adapter
  int64_t per = 0;                // matmuls a slot: 4L
  int64_t rank = 0;               // the widest projection's (padded) rank: xa's row stride
  std::vector<int64_t> order;     // the adapter rows, slot by slot
  std::vector<int64_t> begin;     // [S + 1]: slot s's rows are order[begin[s], begin[s + 1])
  std::vector<char> any;          // [4L]: some row's adapter adapts matmul i
  // the current matmul's x A^T, in order's order: [splits][rows][rank], a partial sum over
  // a share of the inputs each (splits(): 1, or the team)
  std::vector<float> xa;
  int64_t most = 1;  // xa's room: the op's threads

  bool adapts(int64_t i) const { return slot != nullptr && any[i]; }

  // every slot, offset and part checked against its blob and projection (lora_rows.h)
  void check(const c10::optional<torch::Tensor>& slots_arg,
             const std::vector<torch::Tensor>& blobs, const std::vector<torch::Tensor>& index,
             int64_t M, const std::vector<Shape>& shapes) {
    const int64_t S = static_cast<int64_t>(blobs.size());
    TORCH_CHECK(index.size() == blobs.size() && (S == 0 || slots_arg),
                "decode_layers: lora_slots with one lora_index a lora_blob");
    if (!slots_arg) return;
    slots = slots_arg->contiguous();
    TORCH_CHECK(slots.dim() == 1 && slots.size(0) == M && slots.scalar_type() == torch::kInt64,
                "decode_layers: lora_slots must be int64 [M]");
    for (int64_t r = 0; r < M; ++r) {
      const int64_t s = slots.data_ptr<int64_t>()[r];
      TORCH_CHECK(s >= -1 && s < S, "decode_layers: lora slot ", s, " out of range [-1, ", S,
                  ")");
    }
    per = static_cast<int64_t>(shapes.size());
    proj.assign(S * per, Proj{});
    for (int64_t s = 0; s < S; ++s) read_slot(s, blobs[s], index[s], shapes);
    slot = slots.data_ptr<int64_t>();
    begin.assign(S + 1, 0);
    any.assign(per, 0);
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t r = 0; r < M; ++r)
        if (slot[r] == s) order.push_back(r);
      begin[s + 1] = static_cast<int64_t>(order.size());
      for (int64_t i = 0; i < per && begin[s + 1] > begin[s]; ++i)
        any[i] |= proj[s * per + i].rank > 0;
    }
    most = std::max(1, at::get_num_threads());
    xa.assign(order.size() * rank * most, 0.0f);
  }

  // the K ranges of slot s's chunks of matmul i for a team: its own rank's alone decides,
  // so a row sums in the same order whatever else the batch holds
  int64_t splits(size_t s, int64_t i, int64_t team) const {
    return proj[s * per + i].rank / kLanes >= 2 * team ? 1 : std::min(team, most);
  }

  // slot s's projections from its blob and index
  void read_slot(int64_t s, const torch::Tensor& blob, const torch::Tensor& index,
                 const std::vector<Shape>& shapes) {
    const bool bf16_blob = blob.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(blob.dim() == 1 && blob.is_contiguous() &&
                    (bf16_blob || blob.scalar_type() == torch::kFloat32) &&
                    index.is_contiguous() && index.scalar_type() == torch::kInt64 &&
                    index.dim() == 2 && index.size(0) == per && index.size(1) == kIndexWidth,
                "decode_layers: lora_blobs[", s, "] fp32 or bf16 1-D, lora_index[", s,
                "] int64 [4L, ", kIndexWidth, "]");
    const char* base = static_cast<const char*>(blob.data_ptr());
    const int64_t n = blob.numel(), size = blob.element_size();
    for (int64_t i = 0; i < per; ++i) {
      const int64_t* row = index.data_ptr<int64_t>() + i * kIndexWidth;
      Proj& p = proj[s * per + i];
      p.rank = row[1];
      p.bf16 = bf16_blob;
      p.nparts = static_cast<int>(row[2]);
      if (p.rank == 0) continue;
      TORCH_CHECK(p.rank > 0 && p.rank <= 4096 && p.rank % kLanes == 0 && row[0] >= 0 &&
                      row[0] + p.rank * shapes[i].K <= n && p.nparts >= 1 &&
                      p.nparts <= kMaxParts,
                  "decode_layers: lora_index[", s, "] row ", i, ": A^T out of its blob or "
                  "its rank not a multiple of ", kLanes);
      p.at = base + row[0] * size;
      for (int j = 0; j < p.nparts; ++j) {
        const int64_t* q = row + 3 + 5 * j;
        const int64_t rs = q[0], re = q[1], col = q[2], cols = q[3], off = q[4];
        TORCH_CHECK(0 <= rs && rs < re && re <= p.rank && 0 <= col && cols >= 1 &&
                        col + cols <= shapes[i].N && off >= 0 &&
                        off + tiled_size(re - rs, cols) <= n,
                    "decode_layers: lora_index[", s, "] row ", i, " part ", j,
                    " out of its projection or blob");
        p.parts[j] = Part{rs, re, col, cols, base + off * size};
      }
      TORCH_CHECK(!shapes[i].silu, "decode_layers: lora_index[", s, "] adapts gate/up, whose "
                  "bf16 panels apply silu in the matmul");
      rank = std::max(rank, p.rank);
    }
  }

  // thread t of a team of `team`: its chunks of matmul i's x A^T (in: the matmul's input, K
  // wide; xf: the thread's scratch for the rows in fp32); the caller meets after
  template <typename T>
  void shrink(int64_t i, const T* in, int64_t K, std::vector<float>& xf, int64_t t,
              int64_t team) {
    const int64_t rows = static_cast<int64_t>(order.size());
    xf.resize(rows * K);
    for (int64_t j = 0; j < rows; ++j) {
      const T* x = in + order[j] * K;
      float* f = xf.data() + j * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) f[k] = tritonserve_vec::load_f(x + k);
    }
    const int64_t part = rows * rank;
    int64_t unit = 0;
    for (size_t s = 0; s + 1 < begin.size(); ++s) {
      const int64_t b0 = begin[s], b1 = begin[s + 1], split = splits(s, i, team);
      const Proj& p = proj[s * per + i];
      for (int64_t k0 = 0; b1 > b0 && k0 < p.rank; k0 += kLanes)
        for (int64_t h = 0; h < split; ++h, ++unit)
          if (unit % team == t)
            tritonserve_lora::shrink(p, k0, k0 + kLanes, xf.data() + b0 * K, K, h * K / split,
                                     (h + 1) * K / split, b1 - b0,
                                     xa.data() + h * part + b0 * rank, rank);
    }
  }

  // matmul i's x A^T, its partial sums added up (a thread's own copy in `sum`), after the
  // team met
  const float* summed(int64_t i, int64_t team, std::vector<float>& sum) const {
    const int64_t part = static_cast<int64_t>(order.size()) * rank;
    sum.assign(xa.begin(), xa.begin() + part);
    for (size_t s = 0; s + 1 < begin.size(); ++s)
      for (int64_t h = 1; h < splits(s, i, team); ++h) {
        const float* x = xa.data() + h * part;
        for (int64_t j = begin[s] * rank; j < begin[s + 1] * rank; ++j) sum[j] += x[j];
      }
    return sum.data();
  }

  // the adapter rows' (x A^T) B^T added to the columns of the panels `taken` (sorted here) of
  // matmul i, panels `width` columns wide, N outputs (x A^T: summed()'s)
  template <typename T>
  void expand(int64_t i, const float* xa, std::vector<int64_t>& taken, int64_t width,
              int64_t N, T* y, int64_t ldy) const {
    std::sort(taken.begin(), taken.end());
    for (size_t a = 0; a < taken.size();) {
      size_t b = a + 1;
      while (b < taken.size() && taken[b] == taken[b - 1] + 1) ++b;
      const int64_t c0 = taken[a] * width, c1 = std::min(N, (taken[b - 1] + 1) * width);
      for (size_t s = 0; s + 1 < begin.size(); ++s) {
        const int64_t b0 = begin[s], b1 = begin[s + 1];
        if (b1 > b0)
          tritonserve_lora::expand(proj[s * per + i], xa + b0 * rank, rank,
                                   order.data() + b0, b1 - b0, c0, c1, y, ldy);
      }
      a = b;
    }
  }
};

}  // namespace tritonserve_lora
