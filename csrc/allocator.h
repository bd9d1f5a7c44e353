// Block allocator for the paged KV cache: a free list plus a reference count per block
// (vLLM's PagedAttention block manager; shared prompt blocks carry refcount > 1).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace specengine {

class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks) : refcounts_(check_size(num_blocks), 0) {
    free_.reserve(num_blocks);
    for (int64_t id = num_blocks - 1; id >= 0; --id) free_.push_back(id);  // pops 0, 1, 2, ...
  }

  // One free block with refcount 1; std::runtime_error when none is left.
  int64_t allocate() {
    if (free_.empty()) throw std::runtime_error("out of KV blocks");
    int64_t id = free_.back();
    free_.pop_back();
    refcounts_[id] = 1;
    return id;
  }

  // n blocks, or none at all (std::runtime_error) when fewer than n are free.
  std::vector<int64_t> allocate_n(int64_t n) {
    if (n < 0) throw std::invalid_argument("allocate_n: n must be >= 0, got " + std::to_string(n));
    if (n > num_free())
      throw std::runtime_error("out of KV blocks: asked for " + std::to_string(n) + ", " +
                               std::to_string(num_free()) + " free");
    std::vector<int64_t> ids(n);
    for (auto& id : ids) id = allocate();
    return ids;
  }

  void incref(int64_t id) {
    check_live(id, "incref");
    ++refcounts_[id];
  }

  // Drops one reference; the block returns to the free list at zero.
  void free(int64_t id) {
    check_live(id, "free");
    if (--refcounts_[id] == 0) free_.push_back(id);
  }

  int64_t refcount(int64_t id) const {
    check_id(id, "refcount");
    return refcounts_[id];
  }

  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_blocks() const { return static_cast<int64_t>(refcounts_.size()); }

 private:
  static size_t check_size(int64_t n) {
    if (n <= 0) throw std::invalid_argument("num_blocks must be > 0, got " + std::to_string(n));
    return static_cast<size_t>(n);
  }
  void check_id(int64_t id, const char* op) const {
    if (id < 0 || id >= num_blocks())
      throw std::invalid_argument(std::string(op) + ": block id " + std::to_string(id) +
                                  " out of range [0, " + std::to_string(num_blocks()) + ")");
  }
  void check_live(int64_t id, const char* op) const {
    check_id(id, op);
    if (refcounts_[id] == 0)
      throw std::runtime_error(std::string(op) + ": block " + std::to_string(id) +
                               " is not allocated (double free?)");
  }

  std::vector<int64_t> refcounts_;
  std::vector<int64_t> free_;
};

}  // namespace specengine
