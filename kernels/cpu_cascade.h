// Groups of sequences for the shared-prefix (cascade) path of
// cpu_attention.cpp: consecutive sequences of a batch whose block tables
// start with the same physical blocks.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace pagedserve_cpu {

// Shared-prefix (cascade) decode: consecutive sequences whose block tables
// start with the same blocks (a prefix-cache hit, parallel samples) are a
// group, and those blocks are read once for all its query rows, as one
// prefill-like item per chunk of them (16 keys per vector in block_scores),
// instead of once per sequence. Each member then attends to its own blocks
// and merges in the chunks' partial softmax states.
constexpr int MIN_SHARED_BLOCKS = 4;
constexpr int MAX_GROUP_TOKENS = 64;  // bounds an item's rows (qs and acc stay in L2)

struct Group {
  int seq_begin, seq_end;  // its sequences
  int shared;              // leading blocks they all hold, every key visible to each of their tokens
  int chunks;              // prefix items
  size_t part;             // offset of its partial states in the shared buffer
};

// Members have at most max_q_len query tokens (one work item's tile).
inline std::vector<Group> find_groups(const int32_t* tables, int table_stride, const int32_t* seq_lens,
                                      const int32_t* qsl, int num_seqs, int block_size, int max_q_len) {
  // Blocks all of sequence i's query tokens see in full.
  auto visible = [&](int i) {
    const int q_len = qsl[i + 1] - qsl[i];
    return q_len >= 1 && q_len <= max_q_len ? (seq_lens[i] - q_len + 1) / block_size : 0;
  };
  std::vector<Group> groups;
  for (int i = 0; i < num_seqs;) {
    const int32_t* t0 = tables + static_cast<int64_t>(i) * table_stride;
    int shared = visible(i), tokens = qsl[i + 1] - qsl[i], j = i + 1;
    for (; j < num_seqs && shared >= MIN_SHARED_BLOCKS; ++j) {
      const int q_len = qsl[j + 1] - qsl[j];
      const int32_t* tj = tables + static_cast<int64_t>(j) * table_stride;
      const int lim = std::min(shared, visible(j));
      int c = 0;
      while (c < lim && tj[c] == t0[c]) ++c;
      // A later member may not shrink the group's share by more than a quarter.
      if (tokens + q_len > MAX_GROUP_TOKENS || c < MIN_SHARED_BLOCKS || (j > i + 1 && 4 * c < 3 * shared)) break;
      shared = c;
      tokens += q_len;
    }
    if (j - i >= 2) groups.push_back({i, j, shared, 1, 0});
    i = j;
  }
  return groups;
}

}  // namespace pagedserve_cpu
