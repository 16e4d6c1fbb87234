// Key-tile iterators: the one thing that differs between dense, causal, windowed and
// block-sparse attention. The attention main loops (CPU and GPU) are written once against
// this interface, constructed per (batch, head, query tile):
//
//   int  num_tiles()                       how many key tiles the query tile visits
//   int  n_block(it)                       which key tile (in units of kBlockN) is the it-th
//   bool tile_needs_mask(it)               may any element of the it-th tile be hidden?
//   uint64_t visible_bits(it, row, col0)   bit c set iff key n_block(it) * kBlockN + col0 + c is
//                                          visible from query `row` (col0: a multiple of 64, 0 when
//                                          kBlockN <= 64); only called when
//                                          tile_needs_mask(it), once per row and tile, so the
//                                          per-element cost is a bit test
//
// A tile that is not visible at all contributes nothing: the main loops never need to skip.
// Everything here is host+device so both backends share one definition of the semantics.
#pragma once

#include <cstdint>

#include "sparse_attn/params.h"
#include "sparse_attn/plan.h"
#include "sparse_attn/platform.h"

namespace sparse_attn {

SA_HD int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
SA_HD int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// Bits lo..hi (inclusive) set; empty when hi < lo. Bounds are clamped to [0, 63].
SA_HD uint64_t bit_range(int64_t lo, int64_t hi) {
  if (lo < 0) lo = 0;
  if (hi > 63) hi = 63;
  if (hi < lo) return 0;
  return (~uint64_t(0) >> (63 - hi)) & (~uint64_t(0) << lo);
}

// K/V bytes that tile_of_cta's causal order keeps in flight at once (H100 and A100 have 50 and
// 40 MB of L2; the rest holds Q, O and other traffic).
constexpr int64_t kL2GroupBytes = int64_t(32) << 20;

// Which (batch * heads + head, query tile) a CTA runs. Default: query tiles of one (batch, head)
// adjacent, the last first; causal (not block-sparse): heaviest first across the heads of an
// L2-sized group, group after group.
// With a block-sparse q_block_order (nQb entries, heaviest first, then h): the first h listed
// query blocks (rows far heavier than the rest, e.g. global tokens) run first, each over every
// (batch, head), so they do not finish alone at the end; the others run one (batch, head) at a
// time in the listed order, so that the CTAs in flight share one head's K/V in L2. Each query
// block is split into q_block / kBlockM tiles. Returns false for a tile past the end of the
// queries (the grid is rounded up to whole blocks) or for an out-of-range entry.
// Index: the integer type of the arithmetic (int where the caller knows num_ctas fits in it,
// which spares 64-bit divisions; int64_t otherwise).
template <int kBlockM, typename Index>
SA_HD bool tile_of_cta(const AttnFwdParams& p, Index cta, int& bh, int& m_block) {
  static_assert(Index(-1) < Index(0), "tile_of_cta needs a signed index");
  const int num_m = (p.lq + kBlockM - 1) / kBlockM;
  if (p.q_block_order == nullptr) {
    if (p.window_left < 0 && p.window_right >= 0) {
      // Causal: heaviest tiles first, so the last wave holds the lightest tiles; but only across
      // a group of (batch, head)s whose K/V fit in L2 together (kL2GroupBytes), one group after
      // the other, so that the CTAs in flight re-read K/V from L2 rather than from memory (all
      // heads at once stream every head's K/V from DRAM when they exceed L2: 512 MB at
      // B * H = 32, L = 32k, D = 128). The next group's heavy tiles start while the current
      // group's light ones finish, so only the last group's lightest tiles form the tail.
      const Index bhs = Index(p.b) * p.h;
      const int64_t kv_head_bytes = int64_t(p.lk) * (p.d + p.dv) * (p.dtype == ScalarKind::kFloat32 ? 4 : 2);
      const int64_t kv_heads = max64(1, kL2GroupBytes / max64(1, kv_head_bytes));
      const Index group = Index(min64(int64_t(bhs), kv_heads * p.h_per_kv));
      const Index g = cta / (group * num_m), r = cta - g * group * num_m;
      const Index size = bhs - g * group < group ? bhs - g * group : group;  // the last is short
      bh = int(g * group + r % size);
      m_block = num_m - 1 - int(r / size);
    } else {
      bh = int(cta / num_m);
      m_block = num_m - 1 - int(cta % num_m);
    }
    return true;
  }
  const int nqb = p.num_q_blocks, sub = p.q_block / kBlockM;
  const Index bhs = Index(p.b) * p.h;
  int heavy = p.q_block_order[nqb];
  heavy = heavy < 0 ? 0 : (heavy > nqb ? nqb : heavy);
  const Index heavy_ctas = Index(heavy) * sub * bhs;
  int pos, part;
  if (cta < heavy_ctas) {
    pos = int(cta / (sub * bhs));
    const Index r = cta % (sub * bhs);
    bh = int(r / sub);
    part = int(r % sub);
  } else {
    const Index per_head = Index(nqb - heavy) * sub, c = cta - heavy_ctas;
    bh = int(c / per_head);
    pos = heavy + int((c % per_head) / sub);
    part = int(c % sub);
  }
  const int qb = p.q_block_order[pos];
  if (qb < 0 || qb >= nqb) return false;  // a malformed order never reads out of range
  m_block = qb * sub + part;
  return m_block < num_m;
}

// Number of CTAs tile_of_cta expects.
template <int kBlockM>
SA_HD int64_t num_ctas(const AttnFwdParams& p) {
  if (p.q_block_order == nullptr) return int64_t((p.lq + kBlockM - 1) / kBlockM) * p.b * p.h;
  return int64_t(p.num_q_blocks) * (p.q_block / kBlockM) * p.b * p.h;
}

// The band predicate of the dense family: key j is visible from query i iff
// i + off - left <= j <= i + off + right, a negative bound being unbounded.
SA_HD bool window_visible(int64_t i, int64_t j, int off, int left, int right) {
  const int64_t rel = j - i - off;
  return (left < 0 || rel >= -int64_t(left)) && (right < 0 || rel <= right);
}

// Dense attention with an optional band: key j is visible from query i iff
// i + off - left <= j <= i + off + right (a negative bound is unbounded). Causal is (-1, 0).
// Tiles are visited from the last to the first so that the masked diagonal tiles come first.
template <int kBlockM, int kBlockN>
struct WindowTiles {
  int m0, m1;  // query rows [m0, m1) of this tile
  int lk, left, right, off;
  int n_begin, n_end;

  SA_HD WindowTiles(const AttnFwdParams& p, int /*bidb*/, int /*bidh*/, int m_block)
      : m0(m_block * kBlockM),
        m1(int(min64(int64_t(m_block + 1) * kBlockM, p.lq))),
        lk(p.lk),
        left(p.window_left),
        right(p.window_right),
        off(p.kv_offset) {
    const int64_t lo = left < 0 ? 0 : max64(0, int64_t(m0) + off - left);
    const int64_t hi = right < 0 ? lk : min64(lk, int64_t(m1) - 1 + off + right + 1);
    if (hi <= lo) {
      n_begin = n_end = 0;
    } else {
      n_begin = int(lo / kBlockN);
      n_end = int((hi + kBlockN - 1) / kBlockN);
    }
  }

  SA_HD int num_tiles() const { return n_end - n_begin; }
  SA_HD int n_block(int it) const { return n_end - 1 - it; }

  SA_HD bool tile_needs_mask(int it) const {
    const int64_t n0 = int64_t(n_block(it)) * kBlockN, n1 = n0 + kBlockN;
    return n1 > lk || (left >= 0 && n0 < int64_t(m1) - 1 + off - left) ||
           (right >= 0 && n1 - 1 > int64_t(m0) + off + right);
  }

  SA_HD uint64_t visible_bits(int it, int row, int col0 = 0) const {
    const int64_t n0 = int64_t(n_block(it)) * kBlockN + col0, base = int64_t(row) + off - n0;
    const int64_t lo = left < 0 ? 0 : base - left;
    int64_t hi = min64(kBlockN - col0 - 1, lk - 1 - n0);
    if (right >= 0) hi = min64(hi, base + right);
    return bit_range(lo, hi);
  }
};

// Block-sparse attention: the query tile lies inside one mask query block; it visits that
// block's key blocks in ascending order, kv_block / kBlockN tiles each. Full blocks need no
// element mask (only the ragged tail of the keys); partial blocks read their bit mask.
// Indices are re-checked here so that a malformed mask can never address memory out of range:
// an invalid entry becomes a tile with nothing visible.
// kTileIsBlock: the caller guarantees q_block == kBlockM and kv_block == kBlockN (the Hopper
// kernel's launcher checks it), so list entry = key tile and query block = query tile with no
// integer division per key tile.
template <int kBlockM, int kBlockN, bool kTileIsBlock = false>
struct BlockSparseTiles {
  const int32_t* idx;   // (maxKb,) key blocks of this query block
  const int32_t* part;  // (maxKb,) partial mask row or -1
  const int32_t* masks;
  int count, sub, q_block, kv_block, words, row0, lk, nkb, npart;

  SA_HD BlockSparseTiles(const AttnFwdParams& p, int bidb, int bidh, int m_block)
      : masks(p.partial_masks),
        sub(kTileIsBlock ? 1 : p.kv_block / kBlockN),
        q_block(kTileIsBlock ? kBlockM : p.q_block),
        kv_block(kTileIsBlock ? kBlockN : p.kv_block),
        words(kTileIsBlock ? kBlockN / 32 : p.kv_block / 32),
        lk(p.lk),
        nkb(p.num_kv_blocks),
        npart(p.num_partial) {
    const int qb = kTileIsBlock ? m_block : (m_block * kBlockM) / p.q_block;
    row0 = qb * q_block;
    const int64_t row = int64_t(bidb) * p.bs_batch_stride + int64_t(bidh) * p.bs_head_stride + qb;
    const int c = p.kv_num_blocks[row];
    count = c < 0 ? 0 : (c > p.max_kv_blocks ? p.max_kv_blocks : c);
    idx = p.kv_indices + row * p.max_kv_blocks;
    part = p.kv_partial + row * p.max_kv_blocks;
  }

  // A list entry (key block kb, partial mask pid) that addresses nothing out of range.
  SA_HD bool entry_ok(int kb, int pid) const { return kb >= 0 && kb < nkb && pid >= -1 && pid < npart; }
  SA_HD bool block_ok(int e) const { return entry_ok(idx[e], part[e]); }

  SA_HD int num_tiles() const { return kTileIsBlock ? count : count * sub; }

  // Entry of the key-block list that tile it lies in, and which of its sub tiles it is. (A
  // shortcut for sub == 1 made the portable core's D = 128 kernel spill 52 bytes.)
  SA_HD int entry(int it) const { return kTileIsBlock ? it : it / sub; }
  SA_HD int sub_tile(int it) const { return kTileIsBlock ? 0 : it % sub; }

  SA_HD int n_block(int it) const {
    const int e = entry(it);
    return block_ok(e) ? idx[e] * sub + sub_tile(it) : 0;
  }

  // Each list entry read once (two loads, issued together): an invalid entry, a partial block or
  // the keys' ragged tail needs the element mask.
  SA_HD bool tile_needs_mask(int it) const {
    const int e = entry(it);
    const int kb = idx[e], pid = part[e];
    if (!entry_ok(kb, pid)) return true;
    return pid >= 0 || int64_t(kb * sub + sub_tile(it) + 1) * kBlockN > lk;
  }

  // What visible_bits needs, split so that a kernel can read it ahead of its scores (the Hopper
  // core): the list entry of tile it (key block, partial mask id; two loads), then from it the
  // columns of the tile that exist (0 for an invalid entry) and the first mask word of row `row`
  // of the tile, or nullptr when the block has no element mask.
  SA_HD void entry_of(int it, int& kb, int& pid) const {
    const int e = entry(it);
    kb = idx[e];
    pid = part[e];
  }
  SA_HD const int32_t* row_mask_words(int it, int kb, int pid, int row, int& cols) const {
    cols = 0;
    if (!entry_ok(kb, pid)) return nullptr;
    cols = int(min64(kBlockN, lk - (int64_t(kb) * sub + sub_tile(it)) * kBlockN));
    if (pid < 0) return nullptr;
    return masks + (int64_t(pid) * q_block + (row - row0)) * words + sub_tile(it) * kBlockN / 32;
  }

  SA_HD uint64_t visible_bits(int it, int row, int col0 = 0) const {
    static_assert(kBlockN == 32 || kBlockN % 64 == 0, "one or two mask words per call");
    constexpr int kWidth = kBlockN < 64 ? kBlockN : 64;  // columns covered by one call
    int kb, pid, cols;
    entry_of(it, kb, pid);
    const int32_t* w = row_mask_words(it, kb, pid, row, cols);
    const uint64_t in_range = bit_range(0, min64(kWidth - 1, int64_t(cols) - 1 - col0));
    if (w == nullptr) return in_range;  // no element mask (an invalid entry has no columns)
    w += col0 / 32;
    uint64_t bits = uint32_t(w[0]);
    if constexpr (kWidth == 64) bits |= uint64_t(uint32_t(w[1])) << 32;
    return bits & in_range;
  }
};

// The key-major backward's (key block, batch * Hkv + kv head) for CTA (x, y) of its (nKb, B * Hkv)
// grid. With a kv_block_order, the CTAs' launch order (x fastest) runs the heavy key blocks first,
// each over every (batch, kv head), then the others as the grid would: a key block that every query
// block visits (a global token's) would otherwise start as late as its (batch, head) comes and end
// last, alone (Longformer's backward ran 1.9x its density's share of the dense one).
//
// With a head_group (causal masks), the CTAs of head_group (batch, kv head)s at a time run key block
// by key block: the heaviest (key block 0, seen by every query tile) of the last heads no longer
// starts among the last CTAs and ends alone (at 4k, 64 query tiles against ~8 per SM left), and a
// group's Q and dO stay in L2 while its key blocks read them.
SA_HD void bwd_tile_of_cta(const AttnBwdParams& bp, int x, int y, int nkb, int ys, int& n_block, int& by) {
  const int64_t linear = int64_t(y) * nkb + x;
  if (bp.kv_block_order == nullptr && bp.head_group > 0) {
    const int64_t group = linear / (int64_t(bp.head_group) * nkb), first = group * bp.head_group;
    const int heads = int(min64(bp.head_group, ys - first));
    const int64_t r = linear - first * nkb;
    n_block = int(r / heads);
    by = int(first + r % heads);
    return;
  }
  if (bp.kv_block_order == nullptr) {
    n_block = x;
    by = y;
    return;
  }
  const int heavy = *bp.kv_heavy;
  const int64_t front = int64_t(heavy) * ys;
  if (linear < front) {
    n_block = bp.kv_block_order[linear / ys];
    by = int(linear % ys);
  } else {
    const int64_t rest = linear - front;
    const int others = nkb - heavy;
    by = int(rest / others);
    n_block = bp.kv_block_order[heavy + rest % others];
  }
}

// ---- The transposed iterators of the backward: for one key tile of one (batch, kv head), the
// query tiles that see it, over every query head of the kv head's group (GQA reduced in place).
// A cursor Pos walks them: start() gives the first, advance() the next (false at the end);
// needs_mask(pos) says whether any element of the (query tile, key tile) pair may be hidden and
// visible(pos, m, n) whether key n is visible from query m (the forward's semantics). Query rows
// past Lq are never masked here: the backward gives them an LSE of +inf, so their P is 0.

struct QTilePos {
  int hl;           // query head within the group: h = hk * h_per_kv + hl
  int m_block;      // query tile
  int pid;          // block-sparse: partial mask row, -1 full
  int qrow0;        // block-sparse: first query row of the mask block
  int e, s, count;  // block-sparse: list entry, sub tile, entries of head hl
};

template <int kBlockM, int kBlockN>
struct WindowQTiles {
  int heads, lk, left, right, off, n0;
  int h_begin = 0;     // query heads [h_begin, heads) of the group (split_heads)
  int m_begin, m_end;  // query tiles [m_begin, m_end) of every head
  // Each head's walk starts at m_first and wraps around: key tile n_block starts n_block tiles
  // in, so the CTAs of one head, which run together, add into different dQ tiles (starting at
  // m_begin, all of them would add into the same tile at once).
  int m_first;

  SA_HD WindowQTiles(const AttnBwdParams& bp, int /*bidb*/, int /*hk*/, int n_block)
      : heads(bp.fwd.h_per_kv),
        lk(bp.fwd.lk),
        left(bp.fwd.window_left),
        right(bp.fwd.window_right),
        off(bp.fwd.kv_offset),
        n0(n_block * kBlockN) {
    const int64_t n1 = min64(lk, int64_t(n0) + kBlockN);  // keys [n0, n1)
    const int64_t lo = right < 0 ? 0 : max64(0, int64_t(n0) - off - right);
    const int64_t hi = left < 0 ? bp.fwd.lq : min64(bp.fwd.lq, n1 - 1 - off + left + 1);
    if (hi <= lo) {
      m_begin = m_end = 0;
    } else {
      m_begin = int(lo / kBlockM);
      m_end = int((hi + kBlockM - 1) / kBlockM);
    }
    m_first = m_end > m_begin ? m_begin + n_block % (m_end - m_begin) : m_begin;
  }

  // Only the i-th of n equal shares of the group's query heads (AttnBwdParams::head_splits).
  SA_HD void split_heads(int i, int n) {
    const int per = heads / n;
    h_begin = i * per;
    heads = h_begin + per;
  }
  SA_HD bool start(QTilePos& s) const {
    s = QTilePos{h_begin, m_first, -1, 0, 0, 0, 0};
    return m_end > m_begin && heads > h_begin;
  }
  SA_HD bool advance(QTilePos& s) const {
    if (++s.m_block == m_end) s.m_block = m_begin;
    return s.m_block != m_first || ++s.hl < heads;
  }
  SA_HD bool needs_mask(const QTilePos& s) const {
    const int64_t m0 = int64_t(s.m_block) * kBlockM, m1 = m0 + kBlockM;
    return int64_t(n0) + kBlockN > lk || (left >= 0 && n0 < m1 - 1 + off - left) ||
           (right >= 0 && int64_t(n0) + kBlockN - 1 > m0 + off + right);
  }
  SA_HD bool visible(const QTilePos&, int m, int n) const {
    return n < lk && window_visible(m, n, off, left, right);
  }
};

// The walk of the deterministic mode's ordered reductions (AttnBwdParams::dq_order): each head's
// query tiles from the last down, with no rotation, the group's heads innermost, and rank(pos),
// this key tile's place among the key tiles that add into query tile pos.m_block's dQ (they add in
// ascending order). Key tile n - 1 reaches any (query tile, head) no later in its walk than key tile
// n (its range ends no later; with the heads outermost, a causal mask's longer walks of n - 1 would
// hold n back at every head after the first), and the grid runs it no later (bwd_tile_of_cta:
// ascending key tiles per head), so a CTA only ever waits for one started before it; on a dense
// mask the CTAs of a head settle about one tile apart.
template <int kBlockM, int kBlockN>
struct OrderedWindowQTiles : WindowQTiles<kBlockM, kBlockN> {
  using Base = WindowQTiles<kBlockM, kBlockN>;
  SA_HD OrderedWindowQTiles(const AttnBwdParams& bp, int bidb, int hk, int n_block)
      : Base(bp, bidb, hk, n_block) {}

  SA_HD bool start(QTilePos& s) const {
    s = QTilePos{0, this->m_end - 1, -1, 0, 0, 0, 0};
    return this->m_end > this->m_begin && this->heads > 0;
  }
  SA_HD bool advance(QTilePos& s) const {
    if (++s.hl < this->heads) return true;
    s.hl = 0;
    return --s.m_block >= this->m_begin;
  }
  // The key tiles that see query tile m are [n_lo, n_hi), the forward's range (WindowTiles).
  SA_HD int rank(const QTilePos& s) const {
    const int64_t lo = this->left < 0 ? 0 : max64(0, int64_t(s.m_block) * kBlockM + this->off - this->left);
    return this->n0 / kBlockN - int(lo / kBlockN);
  }
};

// Block-sparse: the transposed lists (AttnBwdParams::q_num_blocks, ...); the key tile lies inside
// one key block, each listed query block is q_block / kBlockM query tiles.
template <int kBlockM, int kBlockN>
struct BlockSparseQTiles {
  const int32_t* cnt;   // q_num_blocks of head 0 of the group, this key block
  const int32_t* idx;   // its list
  const int32_t* part;  // its partial mask rows
  const int32_t* masks;
  int64_t head_stride;  // of cnt over the query heads
  int heads, nqb, sub, q_block, kv_block, words, lk, n0, kb;
  int h_begin = 0;  // query heads [h_begin, heads) of the group (split_heads)

  SA_HD BlockSparseQTiles(const AttnBwdParams& bp, int bidb, int hk, int n_block)
      : masks(bp.fwd.partial_masks),
        head_stride(bp.qt_head_stride),
        heads(bp.fwd.h_per_kv),
        nqb(bp.fwd.num_q_blocks),
        sub(bp.fwd.q_block / kBlockM),
        q_block(bp.fwd.q_block),
        kv_block(bp.fwd.kv_block),
        words(bp.fwd.kv_block / 32),
        lk(bp.fwd.lk),
        n0(n_block * kBlockN),
        kb(n_block * kBlockN / bp.fwd.kv_block) {
    const int64_t row = int64_t(bidb) * bp.qt_batch_stride + int64_t(hk) * bp.fwd.h_per_kv * head_stride + kb;
    cnt = bp.q_num_blocks + row;
    idx = bp.q_indices + row * nqb;
    part = bp.q_partial + row * nqb;
  }

  SA_HD int count_of(int hl) const {
    const int c = cnt[hl * head_stride];
    return c < 0 ? 0 : (c > nqb ? nqb : c);
  }
  SA_HD void fill(QTilePos& s) const {
    const int64_t r = int64_t(s.hl) * head_stride * nqb + s.e;
    const int qb = idx[r];
    s.pid = part[r];
    s.qrow0 = qb * q_block;
    s.m_block = qb * sub + s.s;
  }
  SA_HD bool first_head_from(QTilePos& s) const {
    for (; s.hl < heads; ++s.hl) {
      s.count = count_of(s.hl);
      if (s.count > 0) {
        fill(s);
        return true;
      }
    }
    return false;
  }
  // Only the i-th of n equal shares of the group's query heads (AttnBwdParams::head_splits).
  SA_HD void split_heads(int i, int n) {
    const int per = heads / n;
    h_begin = i * per;
    heads = h_begin + per;
  }
  SA_HD bool start(QTilePos& s) const {
    s = QTilePos{h_begin, 0, -1, 0, 0, 0, 0};
    return first_head_from(s);
  }
  SA_HD bool advance(QTilePos& s) const {
    if (++s.s < sub || (s.s = 0, ++s.e < s.count)) {
      fill(s);
      return true;
    }
    s.e = 0;
    ++s.hl;
    return first_head_from(s);
  }
  SA_HD bool needs_mask(const QTilePos& s) const { return s.pid >= 0 || int64_t(n0) + kBlockN > lk; }
  SA_HD bool visible(const QTilePos& s, int m, int n) const {
    if (n >= lk) return false;
    if (s.pid < 0) return true;
    const int c = n - kb * kv_block;
    const int32_t w = masks[(int64_t(s.pid) * q_block + (m - s.qrow0)) * words + c / 32];
    return (uint32_t(w) >> (c % 32)) & 1u;
  }
  // visible() for the 32 elements a Hopper consumer thread holds of a transposed tile, as bits:
  // bit 4 j + e <-> query qrow + 8 j + e % 2, key key_row + 8 (e / 2) (j < 8, e < 4). Needs
  // key_row % 32 < 24, so that both keys lie in one mask word (the consumers' key_row is
  // n0 + 64 wg + 16 warp + g, g < 8), and the key tile to be the key block (kBlockN == kv_block).
  // A full block reads no mask word: only the keys' ragged tail can hide an element.
  SA_HD uint32_t visible_bits_t(const QTilePos& s, int qrow, int key_row) const {
    const uint32_t keys = (key_row < lk ? 0x33333333u : 0u) | (key_row + 8 < lk ? 0xccccccccu : 0u);
    if (s.pid < 0) return keys;
    const int c = key_row - n0;
    const int32_t* w = masks + (int64_t(s.pid) * q_block + (qrow - s.qrow0)) * words + c / 32;
    uint32_t bits = 0;
#pragma unroll 1  // few registers: the caller holds a tile's accumulators
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const uint32_t word = uint32_t(w[(8 * j + r) * words]) >> (c % 32);
        bits |= ((word & 1u) << (4 * j + r)) | (((word >> 8) & 1u) << (4 * j + r + 2));
      }
    }
    return bits & keys;
  }
};

template <Variant V, int kBlockM, int kBlockN>
struct QTilesOf {
  using type = BlockSparseQTiles<kBlockM, kBlockN>;
};
template <int kBlockM, int kBlockN>
struct QTilesOf<Variant::kWindow, kBlockM, kBlockN> {
  using type = WindowQTiles<kBlockM, kBlockN>;
};

// The iterator of a kernel variant (plan.h). kTileIsBlock: block-sparse masks whose blocks are
// exactly the kernel's tiles (BlockSparseTiles).
template <Variant V, int kBlockM, int kBlockN, bool kTileIsBlock = false>
struct TilesOf {
  using type = BlockSparseTiles<kBlockM, kBlockN, kTileIsBlock>;
};
template <int kBlockM, int kBlockN, bool kTileIsBlock>
struct TilesOf<Variant::kWindow, kBlockM, kBlockN, kTileIsBlock> {
  using type = WindowTiles<kBlockM, kBlockN>;
};

}  // namespace sparse_attn
