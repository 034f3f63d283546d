// Applying windows to a TorchScript-loaded torchrec quantized model, in place, while it serves.
//
// The artifact is what deltad.consume.export.export_torchscript writes: the scripted module, its fbgemm
// TBE tensors as attributes `deltad_tbe<i>_<buffer>`, and a JSON manifest (`<artifact>.json`)
// naming every table's TBE, index, shape, dtype and row bytes, the managed-collision tables'
// lookup buffers and every dense parameter / buffer by its trainer state_dict name.
//
// Rows are written with fbgemm's `fbgemm::emb_inplace_update` (called through the dispatcher;
// load fbgemm's libraries first: load_fbgemm). Float rows (fp32 / fp16 / bf16 / int8 wires) are
// packed exactly as torchrec quantizes a table (`fbgemm::FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`
// for int8 / int4, a cast for fp16, the bytes for fp32); packed rows are copied as they are.
//
// What a forward may observe mid-apply (as QuantApplier's "chunk" consistency): every forward
// runs under the shared side of serving_lock(); the applier takes the exclusive side for one
// chunk of rows at a time (chunk_rows), then once for the managed-collision lookup buffers and
// the dense tensors together. A forward therefore never sees a torn row, but may see some rows
// of a window and not others, or the new rows before the new identities / dense weights. A
// window is checked whole before anything is written: one that cannot be applied (a table or
// shape the model lacks, a bad column range, bad identities, a dense tensor of another shape)
// changes nothing and raises ApplyError.
//
// Column slices (column-wise sharded tables, one slice per rank; a packed pull sends them as
// fp32 values), as deltad.consume.quant: an int8 / int4 row is quantized over the whole row, so
// such a table keeps a float32 *shadow* (allocated on its first column slice: 4 bytes per
// element plus a 1-byte "known" mask) holding the newest value of every column. A column slice
// updates the shadow; each row it touches is packed from the shadow and written once every
// column of it is known (until then the model serves the row's previous bytes: pending_rows()).
// Whole-row float slices keep an existing shadow current; a resync (base) window restarts the
// shadows of its tables. fp16 / fp32 rows decode exactly: a column slice is merged with the
// row as served and written at once, no shadow.
#pragma once

#include <torch/script.h>

#include <map>
#include <shared_mutex>
#include <string>
#include <vector>

#include "deltad/consumer.h"
#include "deltad/manifest.h"

namespace deltad {

struct ApplyError : ConsumerError {
  using ConsumerError::ConsumerError;
};

// dlopen fbgemm_gpu's operator libraries in `dir` (the fbgemm_gpu package directory): the
// forward's ops and emb_inplace_update (fbgemm 1.8: fbgemm_gpu_embedding_inplace_ops.so).
// ConfigError if the ops are still missing afterwards.
void load_fbgemm(const std::string& dir);

struct ApplyStats {
  uint64_t rows = 0, chunks = 0, identities = 0, dense = 0;
  double pack_s = 0, write_s = 0;
};

class ModelApplier {
 public:
  ModelApplier(torch::jit::Module module, Manifest manifest, int64_t chunk_rows = 4096);
  // ConfigError unless the sidecars' tables are the artifact's (names, rows, dims, MC).
  void check_tables(const std::vector<TableInfo>& served) const;
  // Check every window, then write it (see the header comment); ApplyError: nothing written.
  ApplyStats apply(const std::vector<RankDelta>& deltas);
  // A benchmark's baseline, not an apply: the window's packed rows already in the tables'
  // layout, written where they lie by one fbgemm::emb_inplace_update per slice (no checks, no
  // serving lock, no chunks, no identities or dense); the op's seconds. bench/cpp_apply.py
  // compares apply() with it.
  double bare_write(const std::vector<RankDelta>& deltas);
  // One forward on the artifact's example inputs, under the serving lock.
  at::Tensor forward_example();
  at::Tensor forward(const std::vector<c10::IValue>& inputs);
  // Tables (uint8 [rows, row_bytes] copies), MC buffers and dense tensors by name, read under
  // the serving lock: "table.<name>", "attr.<attribute>".
  c10::Dict<std::string, at::Tensor> state();
  std::shared_mutex& serving_lock() { return lock_; }
  const Manifest& manifest() const { return manifest_; }
  // Rows of shadowed tables with some columns known but not all (served with old bytes).
  uint64_t pending_rows();

 private:
  struct Table {
    TableSpec spec;
    at::Tensor rows;  // uint8 [num_rows, row_bytes] view of weights_host
    std::vector<int64_t> slot_raw;  // MC: slot -> raw id held
    at::Tensor shadow;  // int tables fed column slices: float32 [num_rows, dim] (or undefined)
    at::Tensor known;   // bool [num_rows, dim]: columns of the shadow received
  };
  at::Tensor attr(const std::string& name) const;
  at::Tensor pack(const Table& t, const at::Tensor& values) const;

  torch::jit::Module module_;
  Manifest manifest_;
  int64_t chunk_rows_;
  std::vector<Table> tables_;
  std::map<std::string, size_t> by_name_;
  std::vector<std::vector<at::Tensor>> tbe_tensors_;  // per TBE: the 6 tensors of the op
  std::shared_mutex lock_;
  std::mutex apply_mutex_;
};

}  // namespace deltad
