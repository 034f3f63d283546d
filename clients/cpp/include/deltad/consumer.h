// deltad's pull protocol in C++: what one rank's GetDelta stream decodes to (RankDelta), the
// stream decoder (WindowAssembler) and the consumer (Consumer: register on every rank, aligned
// pulls, commit after apply, long polls, deadlines and retries, token / TLS / mTLS).
//
// The same rules as the Python client (deltad.consume.client.DeltaConsumer):
//   Consumer c(config); c.connect();
//   PullResult r = c.pull();           // every rank's window, aligned on one trainer step
//   applier.apply(r.deltas);           // your tables now serve r.step
//   c.commit(r);                       // only now do the cursors move (at-least-once)
// A pull whose ranks disagree (generation or step) is dropped whole (r.missing says why) and
// nothing of it is committed. No torch in this header.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace deltad {

namespace v1 {
class GetDeltaResponse;
class GetDeltaRequest;
class StatusResponse;
}  // namespace v1

// Errors: ConfigError = bad input that no retry fixes (another model, rank order, credentials);
// ConsumerError = a call or a window failed (retry later); DecodeError = a malformed stream.
struct ConsumerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ConfigError : ConsumerError {
  using ConsumerError::ConsumerError;
};
struct UnavailableError : ConsumerError {
  using ConsumerError::ConsumerError;
};
struct DecodeError : ConsumerError {
  using ConsumerError::ConsumerError;
};
// A stream asked to continue a broken one (GetDeltaRequest.resume) is not its continuation.
struct NotResumed : DecodeError {
  using DecodeError::DecodeError;
};

enum class Form : int { kIds = 1, kRows = 2, kTopk = 3 };
enum class WireDtype : int {
  kFp32 = 1,
  kFp16 = 2,
  kBf16 = 3,
  kInt8 = 4,
  kPackedInt8 = 5,
  kPackedInt4 = 6,
  kPackedFp16 = 7,
};
bool is_packed(WireDtype d);
const char* wire_dtype_name(WireDtype d);
// "fp32", "packed-int8", ...; throws ConfigError for another name.
WireDtype wire_dtype_of(const std::string& name);
// Bytes of a packed row before padding / padded to `alignment` (0: 16).
uint32_t packed_data_bytes(uint32_t dim, WireDtype d);
uint32_t packed_row_bytes(uint32_t dim, WireDtype d, uint32_t alignment);

// Process-wide allocator tuning for a predictor (glibc; elsewhere it does nothing and returns
// false). A window's buffers up to `keep_bytes` come from the heap, and up to `keep_bytes` of
// freed heap stay mapped, so the next pull reuses resident pages instead of faulting in fresh
// ones (a 12 MB packed window: a pull at 0.6x a bare gRPC stream of its bytes, 0.95x tuned;
// bench/README.md). Bigger buffers are mapped and unmapped as before. Idle memory kept: at
// most `keep_bytes`. Call once, at the start of main; 0: glibc's defaults.
bool tune_allocator(size_t keep_bytes);

// A slot that holds no raw id (managed-collision tables).
constexpr int64_t kEmptyRawId = INT64_MAX;

struct Cursor {
  std::string consumer;
  uint32_t rank = 0;
  uint64_t generation = 0;
  int64_t seq = -1;
  int64_t step = -1;
  std::string pull_id;
};

// Rows of one table slice: write values at [ids, col_start:col_end].
struct SliceUpdate {
  std::string table;
  uint64_t num_rows = 0;
  uint32_t dim = 0, col_start = 0, col_end = 0;
  uint64_t owed = 0;                   // top-k: rows not sent, still owed
  WireDtype dtype = WireDtype::kFp32;  // of this slice's values as they travelled
  uint32_t row_bytes = 0;              // > 0: rows are packed (`packed`), else `values`
  std::vector<int64_t> ids;            // global row ids
  std::vector<float> values;           // [ids, width] dequantized to fp32 (not FORM_IDS)
  std::vector<uint8_t> packed;         // [ids, row_bytes] in the serving table's layout
  bool identities = false;             // a managed-collision slice
  std::vector<int64_t> raw_ids;        // aligned with ids (kEmptyRawId: empty slot)
  std::vector<int64_t> evicted;        // raw ids that left the slice's slots
  std::vector<int64_t> admitted;       // FORM_IDS only
  uint32_t width() const { return col_end - col_start; }
};

// A dense tensor of the trainer (state_dict name), its row-major little-endian bytes.
struct DenseTensor {
  std::string name;
  std::string dtype;  // torch dtype name: "float32", "int64", "bool", ...
  std::vector<int64_t> shape;
  std::string bytes;
};

// One rank's merged window: apply every slice (and dense), then commit `cursor`.
struct RankDelta {
  uint32_t rank = 0;
  uint64_t generation = 0;
  bool resync = false;
  int64_t from_seq = -1, to_seq = -1, to_step = -1;
  Form form = Form::kRows;
  WireDtype dtype = WireDtype::kFp32;
  Cursor cursor;
  bool committed = false;
  uint64_t rows = 0, bytes = 0, dense_bytes = 0;
  std::vector<SliceUpdate> slices;
  std::vector<DenseTensor> dense;
  std::optional<int64_t> dense_step;
  std::optional<uint64_t> generation_diff;
  std::optional<int64_t> rollback_to;
  std::string resync_reason, dense_missing, upstream_lost;
  uint64_t owed() const;
};

// Builds a RankDelta from one GetDelta stream, message by message (every check of
// deltad/consume/decode.py: slices of their tables, chunks in order, sizes, identities,
// dense bytes; DecodeError otherwise).
class WindowAssembler {
 public:
  WindowAssembler();
  ~WindowAssembler();
  void add(const v1::GetDeltaResponse& msg);
  RankDelta result();  // DecodeError if the stream was cut short
  uint64_t messages() const { return messages_; }
  // A broken stream of this window may be continued where it broke: messages arrived, the
  // trailer did not, and the window is one a server builds the same again (a resync; a rows /
  // ids window that is no top-k, generation diff or rollback).
  bool resumable() const;
  // Make `req` ask to continue this window after messages() (pinned to its step); the next
  // header fed to add() must be that continuation (else NotResumed).
  void resume_request(v1::GetDeltaRequest& req);

 private:
  struct Slot;
  std::optional<RankDelta> delta_;
  std::vector<Slot> slots_;
  std::vector<uint64_t> dense_filled_;
  bool trailer_ = false;
  bool resuming_ = false;
  bool resumable_kind_ = false;
  std::string header_bytes_;  // the header without its per-pull marks (resume check)
  uint64_t messages_ = 0;
  uint32_t row_alignment_ = 0;
};

struct ConsumerConfig {
  std::string consumer;
  std::string model = "model";
  std::vector<std::string> sidecars;  // one per rank, in rank order (sidecars or relays)
  Form form = Form::kRows;
  uint64_t k = 0;
  double fraction = 0;
  uint64_t max_rows = 0;
  WireDtype wire_dtype = WireDtype::kFp32;
  uint32_t row_alignment = 0;
  bool dense = true;  // ask for the trainer's dense state
  std::optional<int64_t> max_step;
  double rpc_deadline_s = 30.0;
  double stream_deadline_s = 3600.0;
  int max_retries = 5;
  double backoff_initial_s = 0.1;
  double backoff_max_s = 5.0;
  double overload_wait_s = 300.0;
  double lease_ttl_s = 30.0;
  double heartbeat_interval_s = 5.0;
  std::string token;       // bearer token (or token_file, re-read when it changes)
  std::string token_file;
  std::string tls_ca, tls_cert, tls_key;  // PEM files; a CA or a certificate: TLS
  bool resume = false;     // the caller holds tables its committed cursors describe
};

struct TableInfo {
  std::string name;
  uint64_t num_rows = 0;
  uint32_t dim = 0;
  bool managed_collision = false;
};

struct RankStatus {
  uint32_t rank = 0, world_size = 0;
  uint64_t generation = 0;
  int64_t head_seq = -1, head_step = -1;
  double head_age_s = 0;
  std::vector<int64_t> dense_steps, steps;
  std::optional<int64_t> cap_step;
  uint64_t rollout_version = 0;
  std::string state_unknown;
  std::vector<TableInfo> tables;
};

struct PullResult {
  std::vector<RankDelta> deltas;
  std::map<uint32_t, std::string> missing;  // ranks not in this pull, and why
  std::optional<int64_t> step, head_step, cap_step;
  uint64_t rows() const;
  uint64_t bytes() const;
};

class Consumer {
 public:
  explicit Consumer(ConsumerConfig config);
  ~Consumer();
  Consumer(const Consumer&) = delete;
  Consumer& operator=(const Consumer&) = delete;

  // Check every sidecar's Status (model, rank, world size: ConfigError), register on every
  // rank, start heartbeats. UnavailableError if a sidecar does not answer (after retries).
  void connect();
  void close();
  // Every rank's Status (UnavailableError if one does not answer).
  std::vector<RankStatus> status();
  // Every rank's window, aligned on one trainer step (see the header comment).
  PullResult pull();
  // Commit every rank's cursor of an applied pull; the ranks acknowledged. A failed commit
  // stays pending and is retried before that rank's next pull.
  std::vector<uint32_t> commit(const PullResult& result);
  // The caller's tables no longer hold what the cursors say (a window it could not apply):
  // the next pull of every rank asks for the full tables (GetDelta from_base).
  void request_base();
  // Block until a rank publishes past what this consumer has seen (long-polling Status), or
  // timeout_s, or *stop; true if something is new.
  bool wait_for_new(double timeout_s, const std::atomic<bool>* stop = nullptr);
  size_t world_size() const;
  const ConsumerConfig& config() const { return config_; }

 private:
  struct Rank;
  struct Auth;
  RankStatus status_of(Rank& r);
  RankDelta get_delta(Rank& r, std::optional<int64_t> max_step);
  void flush_pending(Rank& r);
  void heartbeat_loop();
  void open(Rank& r);
  template <class Call>
  auto retry(Rank& r, const char* what, Call&& call, const std::function<bool()>& progressed = {})
      -> decltype(call(nullptr, 0.0));

  ConsumerConfig config_;
  std::unique_ptr<Auth> auth_;
  std::vector<std::unique_ptr<Rank>> ranks_;
  std::atomic<bool> closed_{false};
  std::thread heartbeat_;
  std::mutex hb_mutex_;
  bool connected_ = false;
};

}  // namespace deltad
