// Work handed out a chunk at a time to whichever thread asks first (decode and prefill
// attention, the linears' column tiles).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <vector>

// at::parallel_for splits its range evenly up front, which suits only items of equal cost.
class Claims {
 public:
  Claims(int64_t count, int64_t chunk) : count_(count), chunk_(chunk) {}

  // Threads worth starting: at most one per chunk.
  int64_t threads() const {
    return std::min<int64_t>(at::get_num_threads(), (count_ + chunk_ - 1) / chunk_);
  }

  // The next chunk [begin, end); false when none is left.
  bool next(int64_t& begin, int64_t& end) {
    begin = next_.fetch_add(chunk_, std::memory_order_relaxed);
    end = std::min(begin + chunk_, count_);
    return begin < count_;
  }

 private:
  const int64_t count_, chunk_;
  std::atomic<int64_t> next_{0};
};

// Units item * per + j (j < per) ordered by their item's length, longest first (stable), for
// Claims to hand out: the longest work starts first and the short ends fill in.
inline std::vector<int64_t> longest_first(const int64_t* lens, int64_t items, int64_t per) {
  std::vector<int64_t> order(items * per);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return lens[x / per] > lens[y / per]; });
  return order;
}

// fn(begin, end) over [0, count) in chunks, each to whichever thread asks first. The linears
// split their column tiles so: an even split made one thread wait whenever the other ran
// slower, as the vCPUs of a VM often do (libgomp's waiting was ~8% of a serving run on Zen 3).
template <typename Fn>
void parallel_claims(int64_t count, int64_t chunk, const Fn& fn) {
  Claims claims(count, chunk);
  at::parallel_for(0, claims.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t begin, end; claims.next(begin, end);) fn(begin, end);
  });
}

// Column tiles a claim: about an eighth of a thread's even share.
inline int64_t tile_claim(int64_t tiles) {
  return std::max<int64_t>(1, tiles / (8 * at::get_num_threads()));
}

// fn(begin, end) over a linear's column tiles [0, tiles), tile_claim of them a claim.
template <typename Fn>
void parallel_tiles(int64_t tiles, const Fn& fn) {
  parallel_claims(tiles, tile_claim(tiles), fn);
}

// fn(chunk, begin, end) over chunks of a step's rows x column tiles, claimed as parallel_tiles
// does, a chunk's claims before the next chunk's: the threads work through one chunk of rows
// at a time, which stays in their caches.
template <typename Fn>
void parallel_chunk_tiles(int64_t chunks, int64_t tiles, const Fn& fn) {
  const int64_t per = tile_claim(tiles), claims = (tiles + per - 1) / per;
  parallel_claims(chunks * claims, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t first = u % claims * per;
      fn(u / claims, first, std::min(first + per, tiles));
    }
  });
}
