// GetDelta stream decoding: the checks and the bytes of deltad/consume/decode.py,
// deltad/consume/wirerows.py and deltad/wire.py (values are little-endian; this code assumes a
// little-endian host, as the wire does).
#include <cstring>
#include <string>

#include "deltad/consumer.h"
#include "deltad/v1/delta.pb.h"

namespace deltad {

namespace {

constexpr uint64_t kMaxSliceElements = uint64_t(1) << 36;
constexpr uint32_t kDefaultRowAlignment = 16;
constexpr uint32_t kMaxRowAlignment = 4096;

float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t f;
  if (exp == 0) {
    if (mant == 0) {
      f = sign;
    } else {  // subnormal: normalize
      uint32_t e = 113;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --e;
      }
      f = sign | (e << 23) | ((mant & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    f = sign | 0x7f800000u | (mant << 13);
  } else {
    f = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

float bf16_to_float(uint16_t b) {
  uint32_t f = uint32_t(b) << 16;
  float out;
  std::memcpy(&out, &f, 4);
  return out;
}

uint32_t itemsize(WireDtype d) {
  switch (d) {
    case WireDtype::kFp32:
      return 4;
    case WireDtype::kFp16:
    case WireDtype::kBf16:
      return 2;
    case WireDtype::kInt8:
      return 1;
    default:
      return 0;
  }
}

std::string short_name(const std::string& s) { return s.substr(0, 64); }

template <class T>
void append_le(std::vector<T>& out, const std::string& blob) {
  size_t n = blob.size() / sizeof(T);
  size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, blob.data(), n * sizeof(T));
}

int64_t dtype_itemsize(const std::string& name) {
  if (name == "float32" || name == "int32" || name == "uint32") return 4;
  if (name == "float64" || name == "int64" || name == "uint64") return 8;
  if (name == "float16" || name == "bfloat16" || name == "int16" || name == "uint16") return 2;
  if (name == "int8" || name == "uint8" || name == "bool") return 1;
  return -1;
}

}  // namespace

bool is_packed(WireDtype d) {
  return d == WireDtype::kPackedInt8 || d == WireDtype::kPackedInt4 ||
         d == WireDtype::kPackedFp16;
}

const char* wire_dtype_name(WireDtype d) {
  switch (d) {
    case WireDtype::kFp32:
      return "fp32";
    case WireDtype::kFp16:
      return "fp16";
    case WireDtype::kBf16:
      return "bf16";
    case WireDtype::kInt8:
      return "int8";
    case WireDtype::kPackedInt8:
      return "packed-int8";
    case WireDtype::kPackedInt4:
      return "packed-int4";
    case WireDtype::kPackedFp16:
      return "packed-fp16";
  }
  return "?";
}

WireDtype wire_dtype_of(const std::string& name) {
  for (int i = 1; i <= 7; ++i) {
    auto d = static_cast<WireDtype>(i);
    if (name == wire_dtype_name(d)) return d;
  }
  throw ConfigError("unknown wire dtype '" + name +
                    "' (fp32, fp16, bf16, int8, packed-int8, packed-int4, packed-fp16)");
}

uint32_t packed_data_bytes(uint32_t dim, WireDtype d) {
  switch (d) {
    case WireDtype::kPackedInt8:
      return dim + 4;
    case WireDtype::kPackedInt4:
      return (dim + 1) / 2 + 4;
    case WireDtype::kPackedFp16:
      return 2 * dim;
    default:
      return 0;
  }
}

uint32_t packed_row_bytes(uint32_t dim, WireDtype d, uint32_t alignment) {
  uint32_t a = alignment ? alignment : kDefaultRowAlignment;
  uint32_t n = packed_data_bytes(dim, d);
  return (n + a - 1) / a * a;
}

uint64_t RankDelta::owed() const {
  uint64_t n = 0;
  for (const auto& s : slices) n += s.owed;
  return n;
}

struct WindowAssembler::Slot {
  SliceUpdate update;
  uint64_t count = 0;
  uint64_t filled = 0;
  uint64_t evicted_count = 0, admitted_count = 0;
  bool with_values = true;
};

WindowAssembler::WindowAssembler() = default;
WindowAssembler::~WindowAssembler() = default;

void WindowAssembler::add(const v1::GetDeltaResponse& msg) {
  using v1::GetDeltaResponse;
  switch (msg.msg_case()) {
    case GetDeltaResponse::kHeader: {
      const auto& h = msg.header();
      if (delta_ && resuming_) {
        resuming_ = false;
        if (h.resumed_messages() != messages_)
          throw NotResumed(h.resumed_messages() == 0
                               ? "the sidecar served seq " + std::to_string(h.to_seq()) +
                                     " from its start, not after " + std::to_string(messages_) +
                                     " messages"
                               : "the sidecar resumed after " +
                                     std::to_string(h.resumed_messages()) + " messages, not " +
                                     std::to_string(messages_));
        v1::DeltaHeader b = h;
        b.clear_resync_reason();
        b.clear_resumed_messages();
        if (b.SerializeAsString() != header_bytes_)
          throw NotResumed("the sidecar resumed another window (seq " + std::to_string(h.to_seq()) + ")");
        return;
      }
      if (delta_) throw DecodeError("second header in one stream");
      {
        v1::DeltaHeader a = h;
        a.clear_resync_reason();
        a.clear_resumed_messages();
        header_bytes_ = a.SerializeAsString();
      }
      RankDelta d;
      d.rank = h.rank();
      d.generation = h.generation();
      d.resync = h.resync();
      d.from_seq = h.from_seq();
      d.to_seq = h.to_seq();
      d.to_step = h.to_step();
      int form = h.form() == 0 ? 2 : int(h.form());
      int dtype = h.dtype() == 0 ? 1 : int(h.dtype());
      if (form < 1 || form > 3) throw DecodeError("unknown form " + std::to_string(h.form()));
      if (dtype < 1 || dtype > 7) throw DecodeError("unknown wire dtype " + std::to_string(h.dtype()));
      d.form = static_cast<Form>(form);
      d.dtype = static_cast<WireDtype>(dtype);
      bool with_values = d.form != Form::kIds;
      bool packed = with_values && is_packed(d.dtype);
      uint32_t align = 0;
      if (packed) {
        align = h.row_alignment() ? h.row_alignment() : kDefaultRowAlignment;
        if (align > kMaxRowAlignment || (align & (align - 1)))
          throw DecodeError("row_alignment must be a power of two in [1, 4096], got " +
                            std::to_string(h.row_alignment()));
      }
      row_alignment_ = align;
      for (const auto& s : h.slices()) {
        if (!(s.col_start() <= s.col_end() && s.col_end() <= s.dim()) || s.count() > s.num_rows())
          throw DecodeError("slice '" + short_name(s.table()) + "': not a slice of its table");
        uint64_t w = std::max<uint64_t>(1, s.col_end() - s.col_start());
        if (s.count() > kMaxSliceElements / w)
          throw DecodeError("slice '" + short_name(s.table()) + "': too large");
        if ((s.evicted_count() || s.admitted_count()) && !s.identities())
          throw DecodeError("slice '" + short_name(s.table()) +
                            "': evicted / admitted raw ids without identities");
        if (s.admitted_count() && with_values)
          throw DecodeError("slice '" + short_name(s.table()) + "': admitted raw ids outside ids");
        if (s.evicted_count() + s.admitted_count() > kMaxSliceElements)
          throw DecodeError("slice '" + short_name(s.table()) + "': too many raw ids");
        Slot slot;
        SliceUpdate& u = slot.update;
        u.table = s.table();
        u.num_rows = s.num_rows();
        u.dim = s.dim();
        u.col_start = s.col_start();
        u.col_end = s.col_end();
        u.owed = s.owed();
        u.identities = s.identities();
        u.dtype = d.dtype;
        if (s.dtype() != v1::WIRE_DTYPE_UNSPECIFIED) {
          if (!packed || s.dtype() != v1::WIRE_DTYPE_FP32 || s.row_bytes())
            throw DecodeError("slice '" + short_name(s.table()) + "': dtype " +
                              std::to_string(s.dtype()) + " in a " + wire_dtype_name(d.dtype) +
                              " response (only fp32 slices of a packed one, without row_bytes)");
          u.dtype = WireDtype::kFp32;
        } else if (packed) {
          uint32_t multiple = d.dtype == WireDtype::kPackedInt8   ? 2
                              : d.dtype == WireDtype::kPackedInt4 ? 4
                                                                   : 1;
          bool whole = s.col_start() == 0 && s.col_end() == s.dim();
          uint32_t rb = packed_row_bytes(s.dim(), d.dtype, align);
          if (!whole || s.dim() % multiple || s.row_bytes() != rb)
            throw DecodeError("slice '" + short_name(s.table()) + "': " +
                              std::to_string(s.row_bytes()) + " bytes per " +
                              wire_dtype_name(d.dtype) + " row of dim " + std::to_string(s.dim()) +
                              ", expected " + std::to_string(rb));
          u.row_bytes = rb;
        }
        slot.count = s.count();
        slot.evicted_count = s.evicted_count();
        slot.admitted_count = s.admitted_count();
        slot.with_values = with_values;
        u.ids.reserve(s.count());
        if (u.identities) u.raw_ids.reserve(s.count());
        if (with_values && u.row_bytes)
          u.packed.reserve(s.count() * u.row_bytes);
        else if (with_values)
          u.values.reserve(s.count() * u.width());
        slots_.push_back(std::move(slot));
      }
      if (h.has_dense()) {
        d.dense_step = h.dense().step();
        uint64_t total = 0;
        for (const auto& t : h.dense().tensors()) {
          int64_t item = dtype_itemsize(t.dtype());
          if (item < 0)
            throw DecodeError("dense tensor '" + short_name(t.name()) + "': unknown dtype " +
                              t.dtype());
          uint64_t count = 1;
          DenseTensor dt;
          dt.name = t.name();
          dt.dtype = t.dtype();
          for (auto x : t.shape()) {
            count *= x;
            dt.shape.push_back(int64_t(x));
          }
          total += t.nbytes();
          if (t.nbytes() != count * uint64_t(item) || total > kMaxSliceElements)
            throw DecodeError("dense tensor '" + short_name(t.name()) + "': " +
                              std::to_string(t.nbytes()) + " bytes for " + t.dtype());
          dt.bytes.reserve(t.nbytes());
          d.dense.push_back(std::move(dt));
          dense_filled_.push_back(0);
        }
      }
      d.resync_reason = h.resync_reason();
      d.dense_missing = h.dense_missing();
      d.upstream_lost = h.upstream_lost();
      if (h.has_diff_from_generation()) d.generation_diff = h.diff_from_generation();
      if (h.has_rollback_to_step()) d.rollback_to = h.rollback_to_step();
      resumable_kind_ = h.resync() || !(d.form == Form::kTopk || d.generation_diff || d.rollback_to);
      delta_ = std::move(d);
      return;
    }
    case GetDeltaResponse::kChunk: {
      if (!delta_ || trailer_ || resuming_) throw DecodeError("row chunk outside header..trailer");
      const auto& c = msg.chunk();
      if (c.slice() >= slots_.size())
        throw DecodeError("chunk for slice " + std::to_string(c.slice()) + " of " +
                          std::to_string(slots_.size()));
      Slot& slot = slots_[c.slice()];
      SliceUpdate& u = slot.update;
      uint64_t count = c.count(), end = c.offset() + count;
      if (end > slot.count || c.ids().size() != count * 8)
        throw DecodeError("chunk rows " + std::to_string(c.offset()) + ".." +
                          std::to_string(end) + " outside slice of " + std::to_string(slot.count));
      if (c.offset() != slot.filled)
        throw DecodeError("chunk rows " + std::to_string(c.offset()) + ".." +
                          std::to_string(end) + " of slice " + std::to_string(c.slice()) +
                          ": expected row " + std::to_string(slot.filled) + " next");
      if (!u.identities) {
        if (!c.raw_ids().empty() || !c.evicted().empty() || !c.admitted().empty())
          throw DecodeError("raw ids in a chunk of slice " + std::to_string(c.slice()) +
                            " (not managed)");
      } else {
        if (c.raw_ids().size() != count * 8)
          throw DecodeError("chunk of slice " + std::to_string(c.slice()) +
                            ": raw ids not aligned with its rows");
        if (c.evicted().size() % 8 ||
            u.evicted.size() + c.evicted().size() / 8 > slot.evicted_count)
          throw DecodeError("chunk of slice " + std::to_string(c.slice()) +
                            ": evicted raw ids past its count");
        if (c.admitted().size() % 8 || (slot.with_values && !c.admitted().empty()) ||
            u.admitted.size() + c.admitted().size() / 8 > slot.admitted_count)
          throw DecodeError("chunk of slice " + std::to_string(c.slice()) +
                            ": admitted raw ids past its count");
        append_le(u.raw_ids, c.raw_ids());
        append_le(u.evicted, c.evicted());
        append_le(u.admitted, c.admitted());
      }
      if (slot.with_values && u.row_bytes) {
        if (c.values().size() != count * u.row_bytes)
          throw DecodeError("chunk of " + std::to_string(c.values().size()) + " bytes for " +
                            std::to_string(count) + " packed rows");
        append_le(u.packed, c.values());  // (one memcpy: an insert of chars is a loop)
      } else if (slot.with_values) {
        uint64_t w = u.width(), n = count * w;
        const std::string& v = c.values();
        if (v.size() != n * itemsize(u.dtype))
          throw DecodeError("chunk values of " + std::to_string(v.size()) + " bytes for " +
                            std::to_string(count) + "x" + std::to_string(w));
        size_t at = u.values.size();
        u.values.resize(at + n);
        float* out = u.values.data() + at;
        const char* src = v.data();
        if (u.dtype == WireDtype::kFp32) {
          if (n) std::memcpy(out, src, n * 4);
        } else if (u.dtype == WireDtype::kFp16 || u.dtype == WireDtype::kBf16) {
          for (uint64_t i = 0; i < n; ++i) {
            uint16_t x;
            std::memcpy(&x, src + 2 * i, 2);
            out[i] = u.dtype == WireDtype::kFp16 ? half_to_float(x) : bf16_to_float(x);
          }
        } else {  // int8 row-wise: float(code) * scale, then + bias (two float32 roundings)
          if (c.scale_bias().size() != count * 8)
            throw DecodeError("int8 chunk without a (scale, bias) per row");
          const char* sb = c.scale_bias().data();
          for (uint64_t r = 0; r < count; ++r) {
            float scale, bias;
            std::memcpy(&scale, sb + 8 * r, 4);
            std::memcpy(&bias, sb + 8 * r + 4, 4);
            for (uint64_t j = 0; j < w; ++j) {
              float x = float(static_cast<int8_t>(src[r * w + j]));
              x = x * scale;
              out[r * w + j] = x + bias;
            }
          }
        }
        delta_->bytes += c.scale_bias().size();
      }
      append_le(u.ids, c.ids());
      slot.filled += count;
      delta_->bytes += c.ids().size() + c.values().size() + c.raw_ids().size() +
                       c.evicted().size() + c.admitted().size();
      ++messages_;
      return;
    }
    case GetDeltaResponse::kDense: {
      if (!delta_ || trailer_ || resuming_) throw DecodeError("dense chunk outside header..trailer");
      const auto& c = msg.dense();
      if (c.tensor() >= delta_->dense.size())
        throw DecodeError("dense chunk for tensor " + std::to_string(c.tensor()) + " of " +
                          std::to_string(delta_->dense.size()));
      DenseTensor& t = delta_->dense[c.tensor()];
      uint64_t& filled = dense_filled_[c.tensor()];
      uint64_t want = t.bytes.capacity();
      uint64_t end = c.offset() + c.data().size();
      uint64_t total = 1;
      for (auto x : t.shape) total *= uint64_t(x);
      total *= uint64_t(dtype_itemsize(t.dtype));
      (void)want;
      if (c.offset() != filled || end > total)
        throw DecodeError("dense chunk bytes " + std::to_string(c.offset()) + ".." +
                          std::to_string(end) + " of '" + short_name(t.name) + "': expected byte " +
                          std::to_string(filled) + " next, of " + std::to_string(total));
      t.bytes.append(c.data());
      filled = end;
      delta_->bytes += c.data().size();
      delta_->dense_bytes += c.data().size();
      ++messages_;
      return;
    }
    case GetDeltaResponse::kTrailer: {
      if (!delta_ || resuming_) throw DecodeError("trailer before header");
      if (trailer_) throw DecodeError("second trailer in one stream");
      trailer_ = true;
      const auto& t = msg.trailer();
      const auto& c = t.cursor();
      delta_->cursor = Cursor{c.consumer(), c.rank(), c.generation(), c.seq(), c.step(), c.pull_id()};
      delta_->committed = t.committed();
      return;
    }
    default:
      throw DecodeError("empty GetDeltaResponse");
  }
}

bool WindowAssembler::resumable() const {
  return delta_ && !trailer_ && messages_ > 0 && resumable_kind_;
}

void WindowAssembler::resume_request(v1::GetDeltaRequest& req) {
  req.set_max_step(delta_->to_step);
  auto* r = req.mutable_resume();
  r->set_generation(delta_->generation);
  r->set_to_seq(delta_->to_seq);
  r->set_from_seq(delta_->from_seq);
  r->set_messages(messages_);
  resuming_ = true;
}

RankDelta WindowAssembler::result() {
  if (!delta_ || !trailer_) throw DecodeError("stream ended before its trailer");
  RankDelta d = std::move(*delta_);
  delta_.reset();
  for (auto& s : slots_) {
    if (s.filled != s.count)
      throw DecodeError("slice " + s.update.table + ": " + std::to_string(s.filled) + " of " +
                        std::to_string(s.count) + " rows received");
    if (s.update.evicted.size() != s.evicted_count ||
        (!s.with_values && s.update.identities && s.update.admitted.size() != s.admitted_count))
      throw DecodeError("slice " + s.update.table + ": raw ids missing");
    d.rows += s.count;
  }
  for (size_t i = 0; i < d.dense.size(); ++i) {
    uint64_t total = 1;
    for (auto x : d.dense[i].shape) total *= uint64_t(x);
    total *= uint64_t(dtype_itemsize(d.dense[i].dtype));
    if (dense_filled_[i] != total)
      throw DecodeError("dense tensor '" + short_name(d.dense[i].name) + "': " +
                        std::to_string(dense_filled_[i]) + " of " + std::to_string(total) +
                        " bytes received");
  }
  for (auto& s : slots_) d.slices.push_back(std::move(s.update));
  slots_.clear();
  return d;
}

}  // namespace deltad
