// ModelApplier: windows into a TorchScript-loaded torchrec quantized model (see applier.h).
#include "deltad/applier.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <map>
#include <set>

namespace deltad {

namespace {

using Clock = std::chrono::steady_clock;

double since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool has_op(const char* name) {
  return c10::Dispatcher::singleton().findSchema({name, ""}).has_value();
}

const c10::OperatorHandle& op(const char* name) {
  // (looked up on every call: cheap next to a chunk's copy; handles stay valid)
  static std::map<std::string, c10::OperatorHandle> cache;
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  auto it = cache.find(name);
  if (it == cache.end())
    it = cache.emplace(name, c10::Dispatcher::singleton().findSchemaOrThrow(name, "")).first;
  return it->second;
}

at::ScalarType dense_scalar(const std::string& name) {
  static const std::map<std::string, at::ScalarType> m = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf},
      {"bfloat16", at::kBFloat16}, {"int64", at::kLong}, {"int32", at::kInt},
      {"int16", at::kShort}, {"int8", at::kChar}, {"uint8", at::kByte}, {"bool", at::kBool}};
  auto it = m.find(name);
  if (it == m.end()) throw ApplyError("dense dtype " + name + " is not supported");
  return it->second;
}

WireDtype packed_wire_of(const std::string& table_dtype) {
  if (table_dtype == "int8") return WireDtype::kPackedInt8;
  if (table_dtype == "int4") return WireDtype::kPackedInt4;
  if (table_dtype == "fp16") return WireDtype::kPackedFp16;
  return WireDtype::kFp32;
}

}  // namespace

void load_fbgemm(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw ConfigError("fbgemm directory " + dir + " not found");
  std::vector<std::string> libs;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    std::string name = e.path().filename().string();
    if (name.rfind("fbgemm_gpu_", 0) == 0 && name.size() > 3 &&
        name.compare(name.size() - 3, 3, ".so") == 0)
      libs.push_back(e.path().string());
  }
  std::sort(libs.begin(), libs.end(), [](const std::string& a, const std::string& b) {
    bool pa = a.find("fbgemm_gpu_py.so") != std::string::npos;
    bool pb = b.find("fbgemm_gpu_py.so") != std::string::npos;
    return pa != pb ? pa : a < b;
  });
  std::string errors;
  for (const auto& lib : libs)
    if (!dlopen(lib.c_str(), RTLD_NOW | RTLD_GLOBAL)) errors += std::string(" ") + dlerror();
  for (const char* name : {"fbgemm::emb_inplace_update",
                           "fbgemm::FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf"})
    if (!has_op(name))
      throw ConfigError(std::string("fbgemm op ") + name + " not found after loading " +
                        std::to_string(libs.size()) + " libraries from " + dir + errors);
}

ModelApplier::ModelApplier(torch::jit::Module module, Manifest manifest, int64_t chunk_rows)
    : module_(std::move(module)), manifest_(std::move(manifest)), chunk_rows_(std::max<int64_t>(1, chunk_rows)) {
  module_.eval();
  for (size_t i = 0; i < manifest_.tbes.size(); ++i) {
    std::vector<at::Tensor> ts;
    for (const char* k : {"weights_host", "weights_uvm", "weights_placements", "weights_offsets",
                          "weights_tys", "D_offsets"})
      ts.push_back(attr(manifest_.tbes[i].at(k)));
    if (ts[0].scalar_type() != at::kByte || ts[0].dim() != 1 || !ts[0].is_contiguous())
      throw ConfigError("TBE " + std::to_string(i) + ": weights_host is not a flat uint8 tensor");
    tbe_tensors_.push_back(ts);
  }
  for (const auto& s : manifest_.tables) {
    Table t;
    t.spec = s;
    const at::Tensor& host = tbe_tensors_.at(s.tbe)[0];
    if (s.offset < 0 || s.row_bytes < s.data_bytes ||
        s.offset + s.num_rows * s.row_bytes > host.numel() ||
        tbe_tensors_[s.tbe][3].index({s.index}).item<int64_t>() != s.offset)
      throw ConfigError("table " + s.name + ": the manifest does not describe the artifact's TBE");
    t.rows = host.narrow(0, s.offset, s.num_rows * s.row_bytes).view({s.num_rows, s.row_bytes});
    if (s.mc) {
      at::Tensor sorted = attr(s.mc_sorted), mapping = attr(s.mc_mapping);
      if (sorted.numel() != s.num_rows || mapping.numel() != s.num_rows ||
          sorted.scalar_type() != at::kLong || mapping.scalar_type() != at::kLong)
        throw ConfigError("table " + s.name + ": remapper buffers of another size than its slots");
      t.slot_raw.assign(size_t(s.num_rows), kEmptyRawId);
      auto* sp = sorted.data_ptr<int64_t>();
      auto* mp = mapping.data_ptr<int64_t>();
      for (int64_t i = 0; i < s.num_rows; ++i) {
        int64_t local = mp[i] - s.mc_offset;
        if (local < 0 || local >= s.num_rows) throw ConfigError("table " + s.name + ": bad mapping");
        t.slot_raw[size_t(local)] = sp[i];
      }
    }
    if (by_name_.count(s.name)) throw ConfigError("table " + s.name + " twice in the manifest");
    by_name_[s.name] = tables_.size();
    tables_.push_back(std::move(t));
  }
  for (const auto& [name, a] : manifest_.dense) attr(a);  // (ConfigError if missing)
}

at::Tensor ModelApplier::attr(const std::string& name) const {
  // dotted paths ("model.bottom.0.weight") walk submodules
  torch::jit::Module m = module_;
  std::string rest = name;
  size_t dot;
  while ((dot = rest.find('.')) != std::string::npos) {
    std::string head = rest.substr(0, dot);
    if (!m.hasattr(head)) throw ConfigError("the artifact has no attribute " + name);
    c10::IValue v = m.attr(head);
    if (!v.isModule()) throw ConfigError("the artifact's " + name + " is not under modules");
    m = v.toModule();
    rest = rest.substr(dot + 1);
  }
  if (!m.hasattr(rest)) throw ConfigError("the artifact has no attribute " + name);
  c10::IValue v = m.attr(rest);
  if (!v.isTensor()) throw ConfigError("the artifact's " + name + " is not a tensor");
  return v.toTensor();
}

void ModelApplier::check_tables(const std::vector<TableInfo>& served) const {
  std::string why;
  std::set<std::string> seen;
  for (const auto& s : served) {
    if (!seen.insert(s.name).second) continue;
    auto it = by_name_.find(s.name);
    if (it == by_name_.end()) {
      why += " table '" + s.name + "' is not in the artifact;";
      continue;
    }
    const auto& t = tables_[it->second].spec;
    if (uint64_t(t.num_rows) != s.num_rows || uint32_t(t.dim) != s.dim)
      why += " table '" + s.name + "': served (" + std::to_string(s.num_rows) + ", " +
             std::to_string(s.dim) + "), artifact (" + std::to_string(t.num_rows) + ", " +
             std::to_string(t.dim) + ");";
    if (t.mc != s.managed_collision)
      why += " table '" + s.name + "': managed-collision " +
             (s.managed_collision ? "served, not in the artifact;" : "in the artifact, not served;");
  }
  for (const auto& t : tables_)
    if (!seen.count(t.spec.name)) why += " artifact table '" + t.spec.name + "' is not served;";
  if (!why.empty()) {
    why.pop_back();
    throw ConfigError("the artifact does not match the sidecars' tables:" + why);
  }
}

at::Tensor ModelApplier::pack(const Table& t, const at::Tensor& values) const {
  const auto& s = t.spec;
  int64_t n = values.size(0);
  at::Tensor out = at::zeros({n, s.row_bytes}, at::kByte);
  if (n == 0) return out;
  if (s.dtype == "int8" || s.dtype == "int4") {
    torch::jit::Stack stack{values.contiguous(), int64_t(s.dtype == "int8" ? 8 : 4)};
    op("fbgemm::FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf").callBoxed(&stack);
    at::Tensor q = stack.at(0).toTensor();  // codes, then fp16 scale and bias
    int64_t data = s.data_bytes;
    if (q.size(1) != data) throw ApplyError("table " + s.name + ": fbgemm packed another row size");
    if (s.scale_bias_last) {
      out.narrow(1, 0, data).copy_(q);
    } else {
      out.narrow(1, 0, 4).copy_(q.narrow(1, data - 4, 4));
      out.narrow(1, 4, data - 4).copy_(q.narrow(1, 0, data - 4));
    }
  } else if (s.dtype == "fp16") {
    out.narrow(1, 0, 2 * s.dim).copy_(values.to(at::kHalf).contiguous().view(at::kByte));
  } else if (s.dtype == "fp32") {
    out.narrow(1, 0, 4 * s.dim).copy_(values.contiguous().view(at::kByte));
  } else {
    throw ApplyError("table " + s.name + ": " + s.dtype + " rows are not supported");
  }
  return out;
}

double ModelApplier::bare_write(const std::vector<RankDelta>& deltas) {
  std::lock_guard<std::mutex> serial(apply_mutex_);
  torch::NoGradGuard no_grad;
  double total = 0;
  for (const auto& d : deltas)
    for (const auto& s : d.slices) {  // one op call per slice, on its rows where they are
      auto it = by_name_.find(s.table);
      if (it == by_name_.end() || s.ids.empty()) continue;
      const auto& spec = tables_[it->second].spec;
      if (int64_t(s.row_bytes) != spec.row_bytes) continue;
      int64_t n = int64_t(s.ids.size());
      at::Tensor rows = at::from_blob(const_cast<uint8_t*>(s.packed.data()),
                                      {int64_t(s.packed.size())}, at::kByte);
      at::Tensor ids = at::from_blob(const_cast<int64_t*>(s.ids.data()), {n}, at::kLong);
      at::Tensor tidx = at::full({n}, spec.index, at::kInt);
      at::Tensor offs = at::arange(n, at::kLong).mul_(spec.row_bytes);
      const auto& ts = tbe_tensors_[size_t(spec.tbe)];
      torch::jit::Stack stack{ts[0], ts[1], ts[2], ts[3], ts[4], ts[5], rows, tidx, ids, offs,
                              manifest_.tbe_row_alignment[size_t(spec.tbe)], c10::IValue(),
                              c10::IValue()};
      auto t0 = Clock::now();
      op("fbgemm::emb_inplace_update").callBoxed(&stack);
      total += since(t0);
    }
  return total;
}

ApplyStats ModelApplier::apply(const std::vector<RankDelta>& deltas) {
  std::lock_guard<std::mutex> serial(apply_mutex_);
  torch::NoGradGuard no_grad;
  auto t0 = Clock::now();
  ApplyStats stats;
  struct Part {  // one slice's rows: ids and rows are views of the window (it outlives apply)
    size_t tbe;
    int32_t index;
    at::Tensor ids;   // int64 [n]
    at::Tensor rows;  // uint8 [n, row_bytes], contiguous
  };
  std::vector<Part> writes;
  std::map<size_t, std::vector<std::pair<const SliceUpdate*, size_t>>> idents;
  std::vector<std::pair<at::Tensor, at::Tensor>> dense;
  std::set<size_t> resynced;                                 // tables a base restarts
  std::map<size_t, std::vector<const SliceUpdate*>> partial;  // column slices per table
  std::vector<std::pair<size_t, const SliceUpdate*>> whole_float;  // keep shadows current
  for (const auto& d : deltas) {
    if (d.form == Form::kIds) throw ApplyError("a FORM_IDS window carries no values");
    for (const auto& s : d.slices) {
      auto it = by_name_.find(s.table);
      if (it == by_name_.end()) throw ApplyError("table '" + s.table + "' is not in the artifact");
      Table& t = tables_[it->second];
      const auto& spec = t.spec;
      if (int64_t(s.num_rows) != spec.num_rows || int64_t(s.dim) != spec.dim)
        throw ApplyError("table " + s.table + ": served shape (" + std::to_string(spec.num_rows) +
                         ", " + std::to_string(spec.dim) + ") != sent (" +
                         std::to_string(s.num_rows) + ", " + std::to_string(s.dim) + ")");
      if (!(s.col_start < s.col_end && s.col_end <= s.dim))
        throw ApplyError("table " + s.table + ": bad column range " +
                         std::to_string(s.col_start) + ":" + std::to_string(s.col_end));
      bool whole = s.col_start == 0 && s.col_end == s.dim;
      if (d.resync) resynced.insert(it->second);
      size_t n = s.ids.size();
      // every id in [0, num_rows): one branch-free pass (the op writes where an id points),
      // then the first offender named
      uint64_t bad = 0;
      for (int64_t id : s.ids) bad |= uint64_t(id < 0) | uint64_t(id >= spec.num_rows);
      if (bad)
        for (int64_t id : s.ids)
          if (id < 0 || id >= spec.num_rows)
            throw ApplyError("table " + s.table + ": row id " + std::to_string(id) +
                             " out of range [0, " + std::to_string(spec.num_rows) + ")");
      if (!whole) {  // a column slice: merged below (the shadow), once the window is checked
        if (spec.mc)
          throw ApplyError("table " + s.table +
                           " is managed-collision: column shards are not supported");
        if (s.identities)
          throw ApplyError("table " + s.table + ": raw ids sent for a table without a remapper");
        if (s.row_bytes)
          throw ApplyError("table " + s.table + ": packed rows must cover every column");
        if (s.values.size() != n * s.width())
          throw ApplyError("table " + s.table + ": values not [rows, " +
                           std::to_string(s.width()) + "] (columns " +
                           std::to_string(s.col_start) + ":" + std::to_string(s.col_end) + ")");
        if (n) partial[it->second].push_back(&s);
        continue;
      }
      if (spec.mc) {
        if (!s.identities || s.raw_ids.size() != n)
          throw ApplyError("table " + s.table +
                           " is managed-collision: its rows need raw ids aligned with its slots");
        idents[it->second].push_back({&s, n});
      } else if (s.identities) {
        throw ApplyError("table " + s.table + ": raw ids sent for a table without a remapper");
      }
      if (n == 0) continue;
      at::Tensor rows;
      if (s.row_bytes) {
        if (packed_wire_of(spec.dtype) != d.dtype)
          throw ApplyError("table " + s.table + ": " + wire_dtype_name(d.dtype) +
                           " rows are not the layout of its " + spec.dtype + " rows");
        if (s.packed.size() != n * s.row_bytes || int64_t(s.row_bytes) < spec.data_bytes)
          throw ApplyError("table " + s.table + ": packed rows of " + std::to_string(s.row_bytes) +
                           " bytes, its rows have " + std::to_string(spec.data_bytes));
        at::Tensor wire = at::from_blob(const_cast<uint8_t*>(s.packed.data()),
                                        {int64_t(n), int64_t(s.row_bytes)}, at::kByte);
        if (int64_t(s.row_bytes) > spec.row_bytes &&
            wire.narrow(1, spec.row_bytes, s.row_bytes - spec.row_bytes).any().item<bool>())
          throw ApplyError("table " + s.table + ": packed rows with bytes past the row's padding");
        if (int64_t(s.row_bytes) == spec.row_bytes) {
          rows = wire;  // the table's own layout: written as it came
        } else {
          rows = at::zeros({int64_t(n), spec.row_bytes}, at::kByte);
          int64_t w = std::min<int64_t>(s.row_bytes, spec.row_bytes);
          rows.narrow(1, 0, w).copy_(wire.narrow(1, 0, w));
        }
      } else {
        if (s.values.size() != n * s.width())
          throw ApplyError("table " + s.table + ": values not [rows, dim]");
        at::Tensor v = at::from_blob(const_cast<float*>(s.values.data()),
                                     {int64_t(n), int64_t(s.width())}, at::kFloat);
        rows = pack(t, v);
        whole_float.push_back({it->second, &s});
      }
      at::Tensor ids = at::from_blob(const_cast<int64_t*>(s.ids.data()), {int64_t(n)}, at::kLong);
      writes.push_back({size_t(spec.tbe), int32_t(spec.index), ids, rows.contiguous()});
    }
    for (const auto& dt : d.dense) {
      std::string name = dt.name;
      auto it = manifest_.dense.find(name);
      if (it == manifest_.dense.end() && name.rfind("module.", 0) == 0)
        it = manifest_.dense.find(name.substr(7));
      if (it == manifest_.dense.end()) {
        if (std::find(manifest_.unused_dense.begin(), manifest_.unused_dense.end(), name) !=
            manifest_.unused_dense.end())
          continue;  // not read by the served forward
        throw ApplyError("dense weight '" + name + "' is not in the artifact");
      }
      at::Tensor target = attr(it->second);
      if (target.sizes().vec() != dt.shape)
        throw ApplyError("dense weight " + name + ": sent another shape than served");
      at::ScalarType st = dense_scalar(dt.dtype);
      at::Tensor value =
          at::empty(dt.shape, st).contiguous();
      if (size_t(value.nbytes()) != dt.bytes.size())
        throw ApplyError("dense weight " + name + ": bytes do not match its shape");
      if (!dt.bytes.empty()) std::memcpy(value.data_ptr(), dt.bytes.data(), dt.bytes.size());
      dense.push_back({target, value.to(target.scalar_type())});
    }
  }
  // identities: the new slot -> raw id map of each managed-collision table, checked
  struct IdPlan {
    size_t table;
    std::vector<int64_t> slot_raw;
    at::Tensor sorted, mapping;
  };
  std::vector<IdPlan> id_plans;
  for (auto& [ti, parts] : idents) {
    Table& t = tables_[ti];
    const auto& spec = t.spec;
    std::vector<int64_t> next = t.slot_raw;
    std::vector<int64_t> evicted;
    for (auto& [s, n] : parts) {
      for (size_t i = 0; i < n; ++i) {
        int64_t local = s->ids[i] - spec.mc_offset, raw = s->raw_ids[i];
        if (local < 0 || local >= spec.num_rows)
          throw ApplyError("table " + spec.name + ": slot out of range");
        if (raw < 0) throw ApplyError("table " + spec.name + ": negative raw id " + std::to_string(raw));
        next[size_t(local)] = raw;
      }
      evicted.insert(evicted.end(), s->evicted.begin(), s->evicted.end());
    }
    if (next == t.slot_raw && evicted.empty()) continue;
    at::Tensor slot = at::from_blob(next.data(), {int64_t(next.size())}, at::kLong).clone();
    at::Tensor order = at::argsort(slot, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    at::Tensor sorted = slot.index_select(0, order);
    const int64_t* sp = sorted.data_ptr<int64_t>();
    int64_t held = 0;
    while (held < sorted.numel() && sp[held] != kEmptyRawId) ++held;
    for (int64_t i = 1; i < held; ++i)
      if (sp[i] == sp[i - 1])
        throw ApplyError("table " + spec.name + ": raw id " + std::to_string(sp[i]) +
                         " held by two slots");
    for (int64_t e : evicted)
      if (std::binary_search(sp, sp + held, e))
        throw ApplyError("table " + spec.name + ": raw id " + std::to_string(e) +
                         " evicted but still held by a slot (a slot's new identity is missing)");
    if (next == t.slot_raw) continue;
    id_plans.push_back({ti, std::move(next), sorted, order + spec.mc_offset});
  }
  // column slices: everything is checked; a base restarts its tables' shadows, whole float
  // rows keep a shadow current, then the column slices are merged (rows complete are written)
  for (size_t ti : resynced) {
    tables_[ti].shadow = at::Tensor();
    tables_[ti].known = at::Tensor();
  }
  for (const auto& [ti, s] : whole_float) {
    Table& t = tables_[ti];
    if (!t.shadow.defined()) continue;
    int64_t n = int64_t(s->ids.size());
    at::Tensor ids = at::from_blob(const_cast<int64_t*>(s->ids.data()), {n}, at::kLong);
    at::Tensor v = at::from_blob(const_cast<float*>(s->values.data()), {n, t.spec.dim}, at::kFloat);
    t.shadow.index_copy_(0, ids, v);
    t.known.index_fill_(0, ids, true);
  }
  for (const auto& [ti, slices] : partial) {
    Table& t = tables_[ti];
    const auto& spec = t.spec;
    std::vector<at::Tensor> all;
    for (const SliceUpdate* s : slices)
      all.push_back(at::from_blob(const_cast<int64_t*>(s->ids.data()), {int64_t(s->ids.size())},
                                  at::kLong));
    at::Tensor ids = std::get<0>(at::_unique(at::cat(all), /*sorted=*/true));
    at::Tensor values;
    if (spec.dtype == "fp32" || spec.dtype == "fp16") {
      // fp rows decode exactly: merge with the rows as served, written at once
      at::Tensor served = t.rows.index_select(0, ids);
      values = spec.dtype == "fp32"
                   ? served.narrow(1, 0, 4 * spec.dim).contiguous().view(at::kFloat).clone()
                   : served.narrow(1, 0, 2 * spec.dim).contiguous().view(at::kHalf).to(at::kFloat);
      for (const SliceUpdate* s : slices) {
        int64_t n = int64_t(s->ids.size()), w = int64_t(s->width());
        at::Tensor rows = at::from_blob(const_cast<int64_t*>(s->ids.data()), {n}, at::kLong);
        at::Tensor v = at::from_blob(const_cast<float*>(s->values.data()), {n, w}, at::kFloat);
        values.narrow(1, s->col_start, w).index_copy_(0, at::searchsorted(ids, rows), v);
      }
    } else {
      if (!t.shadow.defined()) {
        t.shadow = at::zeros({spec.num_rows, spec.dim}, at::kFloat);
        t.known = at::zeros({spec.num_rows, spec.dim}, at::kBool);
      }
      for (const SliceUpdate* s : slices) {
        int64_t n = int64_t(s->ids.size()), w = int64_t(s->width());
        at::Tensor rows = at::from_blob(const_cast<int64_t*>(s->ids.data()), {n}, at::kLong);
        at::Tensor v = at::from_blob(const_cast<float*>(s->values.data()), {n, w}, at::kFloat);
        t.shadow.narrow(1, s->col_start, w).index_copy_(0, rows, v);
        t.known.narrow(1, s->col_start, w).index_fill_(0, rows, true);
      }
      ids = ids.masked_select(t.known.index_select(0, ids).all(1));
      values = t.shadow.index_select(0, ids);
    }
    if (ids.numel())
      writes.push_back({size_t(spec.tbe), int32_t(spec.index), ids, pack(t, values).contiguous()});
  }
  stats.pack_s = since(t0);
  // write: rows chunk by chunk, each under the exclusive serving lock
  auto t1 = Clock::now();
  for (const auto& w : writes) {
    int64_t n = w.ids.numel(), rb = w.rows.size(1);
    at::Tensor bytes = w.rows.view({-1});
    // a chunk's rows are passed as their own span of the window's bytes: one table index and
    // one offsets tensor of a chunk's length serve every chunk (nothing of the window's length
    // is allocated or filled here)
    int64_t span = std::min(n, chunk_rows_);
    at::Tensor tidx = at::full({span}, w.index, at::kInt);
    at::Tensor offs = at::arange(span, at::kLong).mul_(rb);
    const auto& ts = tbe_tensors_[w.tbe];
    for (int64_t a = 0; a < n; a += chunk_rows_) {
      int64_t m = std::min(chunk_rows_, n - a);
      torch::jit::Stack stack{ts[0], ts[1], ts[2], ts[3], ts[4], ts[5],
                              bytes.narrow(0, a * rb, m * rb), tidx.narrow(0, 0, m),
                              w.ids.narrow(0, a, m), offs.narrow(0, 0, m),
                              manifest_.tbe_row_alignment[w.tbe], c10::IValue(), c10::IValue()};
      std::unique_lock<std::shared_mutex> g(lock_);
      op("fbgemm::emb_inplace_update").callBoxed(&stack);
      ++stats.chunks;
    }
    stats.rows += uint64_t(n);
  }
  if (!id_plans.empty() || !dense.empty()) {
    std::unique_lock<std::shared_mutex> g(lock_);
    for (auto& p : id_plans) {
      Table& t = tables_[p.table];
      attr(t.spec.mc_sorted).copy_(p.sorted);
      attr(t.spec.mc_mapping).copy_(p.mapping);
      t.slot_raw = std::move(p.slot_raw);
      ++stats.identities;
    }
    for (auto& [target, value] : dense) target.copy_(value);
    stats.dense = dense.size();
  }
  stats.write_s = since(t1);
  return stats;
}

uint64_t ModelApplier::pending_rows() {
  std::lock_guard<std::mutex> serial(apply_mutex_);
  uint64_t n = 0;
  for (const auto& t : tables_)
    if (t.known.defined())
      n += uint64_t((t.known.any(1) & ~t.known.all(1)).sum().item<int64_t>());
  return n;
}

at::Tensor ModelApplier::forward(const std::vector<c10::IValue>& inputs) {
  std::shared_lock<std::shared_mutex> g(lock_);
  c10::InferenceMode guard;
  return module_.forward(inputs).toTensor().clone();
}

at::Tensor ModelApplier::forward_example() {
  std::vector<c10::IValue> inputs;
  for (const auto& name : manifest_.examples) inputs.push_back(attr(name));
  if (inputs.empty()) throw ConfigError("the artifact has no example inputs");
  return forward(inputs);
}

c10::Dict<std::string, at::Tensor> ModelApplier::state() {
  std::shared_lock<std::shared_mutex> g(lock_);
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& t : tables_) {
    out.insert("table." + t.spec.name, t.rows.clone());
    if (t.spec.mc) {
      out.insert("attr." + t.spec.mc_sorted, attr(t.spec.mc_sorted).clone());
      out.insert("attr." + t.spec.mc_mapping, attr(t.spec.mc_mapping).clone());
    }
  }
  for (const auto& [name, a] : manifest_.dense) out.insert("attr." + a, attr(a).detach().clone());
  return out;
}

}  // namespace deltad
