// deltad::Consumer: the pull protocol of deltad/consume/client.py and sidecars.py over gRPC.
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>

#include "deltad/consumer.h"
#include "deltad/v1/delta.grpc.pb.h"

namespace deltad {

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kMaxMessageBytes = 64 * 1024 * 1024;
const char* const kRetryAfterKey = "deltad-retry-after-ms";

// A failed call: its status and the wait the server suggested (RESOURCE_EXHAUSTED).
struct RpcFailed {
  grpc::Status status;
  double retry_after_s = -1;
};

std::string code_name(grpc::StatusCode c) {
  switch (c) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    default: return "CODE_" + std::to_string(int(c));
  }
}

bool retryable(grpc::StatusCode c) {
  return c == grpc::StatusCode::UNAVAILABLE || c == grpc::StatusCode::DEADLINE_EXCEEDED ||
         c == grpc::StatusCode::RESOURCE_EXHAUSTED || c == grpc::StatusCode::ABORTED;
}

std::string read_file(const std::string& what, const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw ConfigError("cannot read " + what + " " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void check_token(const std::string& t, const std::string& where) {
  if (t.empty()) throw ConfigError(where + " is empty");
  for (char ch : t)
    if (ch < '!' || ch > '~')
      throw ConfigError(where + ": the token must be printable ASCII without spaces");
}

std::string first_line(const std::string& s) {
  std::istringstream in(s);
  std::string line;
  while (std::getline(in, line)) {
    auto b = line.find_first_not_of(" \t\r");
    if (b == std::string::npos) continue;
    auto e = line.find_last_not_of(" \t\r");
    return line.substr(b, e - b + 1);
  }
  return "";
}

double jitter(double x) {
  thread_local std::mt19937 gen{std::random_device{}()};
  return x * std::uniform_real_distribution<double>(0.5, 1.0)(gen);
}

std::chrono::system_clock::time_point deadline_in(double s) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(int64_t(std::max(0.0, s) * 1e6));
}

Cursor cursor_of(const v1::Cursor& c) {
  return Cursor{c.consumer(), c.rank(), c.generation(), c.seq(), c.step(), c.pull_id()};
}

void cursor_to(const Cursor& c, v1::Cursor* out) {
  out->set_consumer(c.consumer);
  out->set_rank(c.rank);
  out->set_generation(c.generation);
  out->set_seq(c.seq);
  out->set_step(c.step);
  out->set_pull_id(c.pull_id);
}

// Run fn(i) for i in [0, n) on threads; exceptions come back per index.
std::vector<std::exception_ptr> parallel(size_t n, const std::function<void(size_t)>& fn) {
  std::vector<std::exception_ptr> errs(n);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errs[i] = std::current_exception();
      }
    });
  for (auto& t : threads) t.join();
  return errs;
}

// ConfigError is rethrown (no retry fixes it); other errors become their message.
std::string error_text(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ConfigError&) {
    throw;
  } catch (const std::exception& x) {
    return x.what();
  }
}

std::string unknown_state(const std::string& rollout_state) {
  if (rollout_state.find("\"unknown\":true") == std::string::npos &&
      rollout_state.find("\"unknown\": true") == std::string::npos)
    return "";
  auto at = rollout_state.find("\"why\":");
  if (at == std::string::npos) return "not known";
  auto q = rollout_state.find('"', at + 6);
  auto e = q == std::string::npos ? q : rollout_state.find('"', q + 1);
  if (e == std::string::npos) return "not known";
  return rollout_state.substr(q + 1, std::min<size_t>(300, e - q - 1));
}

}  // namespace

// ---- credentials ---------------------------------------------------------------------------

struct Consumer::Auth {
  explicit Auth(const ConsumerConfig& c) : cfg(c) {
    if (c.tls_cert.empty() != c.tls_key.empty())
      throw ConfigError("a client certificate and its key go together");
    if (!c.token.empty()) {
      check_token(c.token, "the token");
      token = c.token;
    }
    if (!c.token_file.empty()) load_token(true);
    if (!c.tls_ca.empty() || !c.tls_cert.empty()) {
      grpc::SslCredentialsOptions o;
      if (!c.tls_ca.empty()) o.pem_root_certs = read_file("TLS CA", c.tls_ca);
      if (!c.tls_cert.empty()) {
        o.pem_cert_chain = read_file("TLS client certificate", c.tls_cert);
        o.pem_private_key = read_file("TLS client key", c.tls_key);
      }
      creds = grpc::SslCredentials(o);
    } else {
      creds = grpc::InsecureChannelCredentials();
    }
  }

  void load_token(bool strict) {
    struct stat st {};
    if (stat(cfg.token_file.c_str(), &st) != 0) {
      if (strict) throw ConfigError("cannot read token file " + cfg.token_file);
      return;
    }
    std::string stamp = std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) + ":" +
                        std::to_string(st.st_mtim.tv_sec) + "." +
                        std::to_string(st.st_mtim.tv_nsec);
    if (stamp == token_stamp) return;
    try {
      std::string t = first_line(read_file("token file", cfg.token_file));
      check_token(t, "token file " + cfg.token_file);
      token = t;
      token_stamp = stamp;
    } catch (const ConfigError&) {
      if (strict) throw;  // (mid-rotation: the previous token stays)
    }
  }

  void decorate(grpc::ClientContext& ctx) {
    std::lock_guard<std::mutex> g(mu);
    if (!cfg.token_file.empty()) load_token(false);
    if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
  }

  std::shared_ptr<grpc::Channel> channel(const std::string& endpoint) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(kMaxMessageBytes);
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, int(cfg.backoff_initial_s * 1000));
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, int(cfg.backoff_max_s * 1000));
    return grpc::CreateCustomChannel(endpoint, creds, args);
  }

  ConsumerConfig cfg;
  std::mutex mu;
  std::string token, token_stamp;
  std::shared_ptr<grpc::ChannelCredentials> creds;
};

struct Consumer::Rank {
  uint32_t rank = 0;
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::DeltaService::Stub> stub;
  std::mutex mu;
  std::optional<Cursor> pending, committed;
  bool needs_base = true;
  std::pair<uint64_t, int64_t> seen{0, -1};
  std::optional<uint64_t> rollout_version;
  std::optional<uint64_t> checked_generation;
};

// ---- lifecycle -----------------------------------------------------------------------------

Consumer::Consumer(ConsumerConfig config) : config_(std::move(config)) {
  if (config_.sidecars.empty()) throw ConfigError("set the sidecars (one per rank)");
  if (config_.consumer.empty()) throw ConfigError("set the consumer name");
  auth_ = std::make_unique<Auth>(config_);
}

Consumer::~Consumer() { close(); }

size_t Consumer::world_size() const { return ranks_.size(); }

void Consumer::open(Rank& r) {
  r.channel = auth_->channel(r.endpoint);
  r.stub = v1::DeltaService::NewStub(r.channel);
}

void Consumer::connect() {
  if (connected_) return;
  closed_ = false;
  ranks_.clear();
  for (size_t i = 0; i < config_.sidecars.size(); ++i) {
    auto r = std::make_unique<Rank>();
    r->rank = uint32_t(i);
    r->endpoint = config_.sidecars[i];
    r->needs_base = !config_.resume;
    open(*r);
    ranks_.push_back(std::move(r));
  }
  connected_ = true;
  try {
    auto errs = parallel(ranks_.size(), [&](size_t i) { status_of(*ranks_[i]); });
    for (auto& e : errs)
      if (e) std::rethrow_exception(e);
    errs = parallel(ranks_.size(), [&](size_t i) {
      Rank& r = *ranks_[i];
      v1::RegisterRequest req;
      req.set_consumer(config_.consumer);
      req.set_lease_ttl_seconds(config_.lease_ttl_s);
      auto resp = retry(r, "Register", [&](grpc::ClientContext* ctx, double timeout) {
        ctx->set_deadline(deadline_in(timeout));
        v1::RegisterResponse out;
        grpc::Status s = r.stub->Register(ctx, req, &out);
        if (!s.ok()) throw RpcFailed{s};
        return out;
      });
      if (resp.cursor().rank() != r.rank)
        throw ConfigError("sidecar " + r.endpoint + " serves rank " +
                          std::to_string(resp.cursor().rank()) + ", but it is listed as rank " +
                          std::to_string(r.rank) + ": list the sidecars in rank order");
      std::lock_guard<std::mutex> g(r.mu);
      r.committed = cursor_of(resp.cursor());
    });
    for (auto& e : errs)
      if (e) std::rethrow_exception(e);
  } catch (...) {
    close();
    throw;
  }
  heartbeat_ = std::thread([this] { heartbeat_loop(); });
}

void Consumer::close() {
  if (!connected_) return;
  {
    std::lock_guard<std::mutex> g(hb_mutex_);
    closed_ = true;
  }
  if (heartbeat_.joinable()) heartbeat_.join();
  bool any = false;
  for (auto& r : ranks_) {
    std::lock_guard<std::mutex> g(r->mu);
    any = any || (r->committed && r->committed->seq >= 0);
  }
  if (!any) {  // end the lease of a consumer that committed nothing (best effort)
    for (auto& r : ranks_) {
      grpc::ClientContext ctx;
      auth_->decorate(ctx);
      ctx.set_deadline(deadline_in(std::min(2.0, config_.rpc_deadline_s)));
      v1::HeartbeatRequest req;
      req.set_consumer(config_.consumer);
      req.set_release(true);
      v1::HeartbeatResponse out;
      r->stub->Heartbeat(&ctx, req, &out);
    }
  }
  connected_ = false;
}

void Consumer::heartbeat_loop() {
  auto interval = std::chrono::milliseconds(
      int64_t(std::max(0.05, config_.heartbeat_interval_s) * 1000));
  auto next = Clock::now() + interval;
  while (true) {
    while (Clock::now() < next) {
      if (closed_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    next = Clock::now() + interval;
    for (auto& rp : ranks_) {
      if (closed_) return;
      Rank& r = *rp;
      grpc::ClientContext ctx;
      auth_->decorate(ctx);
      ctx.set_deadline(deadline_in(std::min(config_.heartbeat_interval_s, config_.rpc_deadline_s)));
      v1::HeartbeatRequest req;
      req.set_consumer(config_.consumer);
      v1::HeartbeatResponse out;
      grpc::Status s = r.stub->Heartbeat(&ctx, req, &out);
      if (s.error_code() == grpc::StatusCode::NOT_FOUND) {  // lease expired: register again
        try {
          grpc::ClientContext c2;
          auth_->decorate(c2);
          c2.set_deadline(deadline_in(config_.rpc_deadline_s));
          v1::RegisterRequest rr;
          rr.set_consumer(config_.consumer);
          rr.set_lease_ttl_seconds(config_.lease_ttl_s);
          v1::RegisterResponse ro;
          r.stub->Register(&c2, rr, &ro);
        } catch (...) {
        }
      }
    }
  }
}

// ---- calls ---------------------------------------------------------------------------------

template <class Call>
auto Consumer::retry(Rank& r, const char* what, Call&& call,
                     const std::function<bool()>& progressed) -> decltype(call(nullptr, 0.0)) {
  double delay = config_.backoff_initial_s;
  std::optional<Clock::time_point> overloaded_until;
  grpc::Status last;
  int attempt = 0;
  auto sleep = [&](double s) {
    auto end = Clock::now() + std::chrono::microseconds(int64_t(s * 1e6));
    while (Clock::now() < end && !closed_)
      std::this_thread::sleep_for(std::min<Clock::duration>(end - Clock::now(),
                                                            std::chrono::milliseconds(50)));
  };
  while (attempt <= config_.max_retries) {
    if (closed_) break;
    grpc::ClientContext ctx;
    auth_->decorate(ctx);
    try {
      return call(&ctx, config_.rpc_deadline_s);
    } catch (RpcFailed& f) {
      auto code = f.status.error_code();
      std::string where = "rank " + std::to_string(r.rank) + " " + what + " at " + r.endpoint +
                          ": " + code_name(code) + ": " + f.status.error_message();
      if (code == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        auto now = Clock::now();
        if (!overloaded_until)
          overloaded_until =
              now + std::chrono::microseconds(int64_t(config_.overload_wait_s * 1e6));
        double left = std::chrono::duration<double>(*overloaded_until - now).count();
        if (left <= 0) throw ConsumerError(where + " (still overloaded after overload_wait_s)");
        const auto& md = ctx.GetServerTrailingMetadata();
        auto it = md.find(kRetryAfterKey);
        double wait;
        if (it != md.end()) {
          double hint = std::min(60.0, std::max(0.0, std::atof(std::string(it->second.data(), it->second.size()).c_str()) / 1000));
          wait = hint * (1 + jitter(1.0) - 0.5);
        } else {
          wait = jitter(delay);
          delay = std::min(delay * 2, config_.backoff_max_s);
        }
        sleep(std::min(wait, left));
        continue;
      }
      if (!retryable(code)) {
        if (std::string(what) == "Commit" && (code == grpc::StatusCode::FAILED_PRECONDITION ||
                                              code == grpc::StatusCode::NOT_FOUND))
          throw RpcFailed{f.status};  // refused for good: the caller drops the cursor
        if (code == grpc::StatusCode::UNAUTHENTICATED || code == grpc::StatusCode::PERMISSION_DENIED)
          throw ConfigError(where);
        throw ConsumerError(where);
      }
      last = f.status;
    }
    // an attempt that brought messages the next one goes on from counts as none
    bool free = progressed && progressed();
    if (free) delay = config_.backoff_initial_s;
    if (free || attempt < config_.max_retries) {
      sleep(jitter(delay));
      delay = std::min(delay * 2, config_.backoff_max_s);
    }
    if (!free) ++attempt;
  }
  throw UnavailableError("rank " + std::to_string(r.rank) + " " + what + " at " + r.endpoint +
                         ": no answer after " + std::to_string(config_.max_retries + 1) +
                         " attempts (" + code_name(last.error_code()) + ": " +
                         last.error_message() + ")");
}

RankStatus Consumer::status_of(Rank& r) {
  v1::StatusRequest req;
  req.set_consumer(config_.consumer);
  v1::StatusResponse s = retry(r, "Status", [&](grpc::ClientContext* ctx, double timeout) {
    ctx->set_deadline(deadline_in(timeout));
    v1::StatusResponse out;
    grpc::Status st = r.stub->Status(ctx, req, &out);
    if (!st.ok()) throw RpcFailed{st};
    return out;
  });
  if (s.model() != config_.model)
    throw ConfigError(r.endpoint + " serves model '" + s.model() + "', not '" + config_.model + "'");
  if (s.rank() != r.rank)
    throw ConfigError("sidecar " + r.endpoint + " serves rank " + std::to_string(s.rank()) +
                      ", but it is listed as rank " + std::to_string(r.rank) +
                      ": list the sidecars in rank order (one per rank)");
  if (s.world_size() && s.world_size() != ranks_.size())
    throw ConfigError("model '" + config_.model + "' has " + std::to_string(s.world_size()) +
                      " ranks; give one sidecar per rank (got " + std::to_string(ranks_.size()) +
                      ")");
  RankStatus out;
  out.rank = s.rank();
  out.world_size = s.world_size();
  out.generation = s.generation();
  out.head_seq = s.head_seq();
  out.head_step = s.head_step();
  out.head_age_s = s.head_age_seconds();
  out.dense_steps.assign(s.dense_steps().begin(), s.dense_steps().end());
  out.steps.assign(s.steps().begin(), s.steps().end());
  if (!s.rollout_state().empty() && s.cap_step() >= 0) out.cap_step = s.cap_step();
  out.rollout_version = s.rollout_version();
  out.state_unknown = unknown_state(s.rollout_state());
  for (const auto& t : s.tables())
    out.tables.push_back(TableInfo{t.table(), t.num_rows(), t.dim(), t.managed_collision()});
  std::lock_guard<std::mutex> g(r.mu);
  if (s.world_size()) r.checked_generation = s.generation();
  r.seen = std::max(r.seen, std::make_pair(uint64_t(s.generation()), int64_t(s.head_seq())));
  if (!s.rollout_state().empty())
    r.rollout_version = s.rollout_version();
  else
    r.rollout_version.reset();
  return out;
}

std::vector<RankStatus> Consumer::status() {
  std::vector<RankStatus> out(ranks_.size());
  auto errs = parallel(ranks_.size(), [&](size_t i) { out[i] = status_of(*ranks_[i]); });
  for (auto& e : errs)
    if (e) std::rethrow_exception(e);
  return out;
}

void Consumer::flush_pending(Rank& r) {
  std::optional<Cursor> cursor;
  {
    std::lock_guard<std::mutex> g(r.mu);
    cursor = r.pending;
  }
  if (!cursor) return;
  v1::CommitRequest req;
  req.set_consumer(config_.consumer);
  cursor_to(*cursor, req.mutable_cursor());
  std::optional<Cursor> stored;
  bool dropped_not_found = false;
  try {
    auto resp = retry(r, "Commit", [&](grpc::ClientContext* ctx, double timeout) {
      ctx->set_deadline(deadline_in(timeout));
      v1::CommitResponse out;
      grpc::Status s = r.stub->Commit(ctx, req, &out);
      if (!s.ok()) throw RpcFailed{s};
      return out;
    });
    stored = cursor_of(resp.committed());
  } catch (RpcFailed& f) {  // refused for good: the next pull re-sends what is owed
    dropped_not_found = f.status.error_code() == grpc::StatusCode::NOT_FOUND;
  }
  std::lock_guard<std::mutex> g(r.mu);
  if (r.pending && r.pending->seq == cursor->seq && r.pending->pull_id == cursor->pull_id &&
      r.pending->generation == cursor->generation)
    r.pending.reset();
  if (stored)
    r.committed = stored;
  else if (dropped_not_found)
    r.committed.reset();
}

RankDelta Consumer::get_delta(Rank& r, std::optional<int64_t> max_step) {
  v1::GetDeltaRequest req;
  req.set_consumer(config_.consumer);
  req.set_form(static_cast<v1::Form>(int(config_.form)));
  req.set_k(config_.k);
  req.set_fraction(config_.fraction);
  req.set_max_rows(config_.max_rows);
  req.set_dtype(static_cast<v1::WireDtype>(int(config_.wire_dtype)));
  req.set_auto_commit(false);  // committed once every rank agreed and the pull was applied
  if (is_packed(config_.wire_dtype)) req.set_row_alignment(config_.row_alignment);
  req.set_with_dense(config_.dense);
  {
    std::lock_guard<std::mutex> g(r.mu);
    req.set_from_base(r.needs_base);
  }
  if (max_step) req.set_max_step(*max_step);
  // One window across the attempts that pull it: a broken stream is asked to go on where it
  // broke (GetDeltaRequest.resume) unless the sidecar declined a resume once.
  std::unique_ptr<WindowAssembler> last;
  bool declined = false;
  uint64_t began = 0;
  auto resumes = [&] { return last && last->resumable() && !declined; };
  auto progressed = [&] { return resumes() && last->messages() > began; };
  RankDelta d = retry(r, "GetDelta", [&](grpc::ClientContext* ctx, double timeout) {
    v1::GetDeltaRequest ask = req;
    if (resumes())
      last->resume_request(ask);
    else
      last = std::make_unique<WindowAssembler>();
    WindowAssembler& asm_ = *last;
    began = asm_.messages();
    ctx->set_deadline(deadline_in(std::max(timeout, config_.stream_deadline_s)));
    // a stream that stalls for `timeout` (no message) is cancelled and retried
    // (the watcher wakes every 20 ms to look, and at once when the stream ends: a pull never
    // waits for its watcher's nap)
    std::atomic<int64_t> last_ns{Clock::now().time_since_epoch().count()};
    std::atomic<bool> stalled{false};
    bool done = false;
    std::mutex watch_mu;
    std::condition_variable watch_cv;
    std::thread watch([&] {
      auto limit = std::chrono::duration_cast<Clock::duration>(
          std::chrono::microseconds(int64_t(timeout * 1e6)));
      std::unique_lock<std::mutex> lk(watch_mu);
      while (!done) {
        watch_cv.wait_for(lk, std::chrono::milliseconds(20));
        if (done) return;
        if (Clock::now() - Clock::time_point(Clock::duration(last_ns.load())) > limit || closed_) {
          stalled = true;
          ctx->TryCancel();
          return;
        }
      }
    });
    auto end_watch = [&] {
      {
        std::lock_guard<std::mutex> lk(watch_mu);
        done = true;
      }
      watch_cv.notify_all();
      watch.join();
    };
    v1::GetDeltaResponse msg;
    grpc::Status st;
    try {
      auto reader = r.stub->GetDelta(ctx, ask);
      while (reader->Read(&msg)) {
        last_ns = Clock::now().time_since_epoch().count();
        asm_.add(msg);
      }
      st = reader->Finish();
    } catch (const NotResumed& e) {  // served from its start: start over, no more resumes
      ctx->TryCancel();
      end_watch();
      declined = true;
      last.reset();
      throw RpcFailed{grpc::Status(grpc::StatusCode::ABORTED, e.what())};
    } catch (...) {
      ctx->TryCancel();
      end_watch();
      throw;
    }
    end_watch();
    if (stalled && !st.ok())
      throw RpcFailed{grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "the stream stalled")};
    if (!st.ok()) throw RpcFailed{st};
    return asm_.result();
  }, progressed);
  std::lock_guard<std::mutex> g(r.mu);
  r.seen = std::max(r.seen, std::make_pair(d.generation, d.to_seq));
  return d;
}

bool tune_allocator(size_t keep_bytes) {
#ifdef __GLIBC__
  if (keep_bytes == 0) return true;
  int keep = int(std::min<size_t>(keep_bytes, size_t(1) << 30));
  return mallopt(M_MMAP_THRESHOLD, keep) == 1 && mallopt(M_TRIM_THRESHOLD, keep) == 1;
#else
  (void)keep_bytes;
  return false;
#endif
}

// ---- the consumer API ----------------------------------------------------------------------

uint64_t PullResult::rows() const {
  uint64_t n = 0;
  for (const auto& d : deltas) n += d.rows;
  return n;
}

uint64_t PullResult::bytes() const {
  uint64_t n = 0;
  for (const auto& d : deltas) n += d.bytes;
  return n;
}

PullResult Consumer::pull() {
  if (!connected_) throw ConsumerError("Consumer is not connected (connect() first)");
  PullResult result;
  auto errs = parallel(ranks_.size(), [&](size_t i) { flush_pending(*ranks_[i]); });
  for (size_t i = 0; i < errs.size(); ++i)
    if (errs[i]) result.missing[uint32_t(i)] = "pending commit: " + error_text(errs[i]);
  std::vector<RankStatus> st(ranks_.size());
  errs = parallel(ranks_.size(), [&](size_t i) { st[i] = status_of(*ranks_[i]); });
  for (size_t i = 0; i < errs.size(); ++i)
    if (errs[i]) result.missing[uint32_t(i)] = error_text(errs[i]);
  if (!result.missing.empty()) return result;
  // aligned: every rank at one generation with something published, the release state known
  std::set<uint64_t> gens;
  for (auto& s : st) gens.insert(s.generation);
  for (auto& s : st)
    if (!s.state_unknown.empty()) result.missing[s.rank] = "release state " + s.state_unknown;
  if (!result.missing.empty()) return result;
  bool published = std::all_of(st.begin(), st.end(), [](auto& s) { return s.head_seq >= 0; });
  if (gens.size() > 1 || !published) {
    for (auto& s : st)
      result.missing[s.rank] = s.head_seq < 0 ? "nothing published yet"
                                              : "generation " + std::to_string(s.generation) +
                                                    " head seq " + std::to_string(s.head_seq) +
                                                    ": ranks not aligned yet";
    return result;
  }
  int64_t target = INT64_MAX, head = INT64_MIN;
  std::optional<int64_t> cap;
  for (auto& s : st) {
    target = std::min(target, s.head_step);
    head = std::max(head, s.head_step);
    if (s.cap_step) cap = cap ? std::min(*cap, *s.cap_step) : *s.cap_step;
  }
  if (cap) target = std::min(target, *cap);
  if (config_.max_step) target = std::min(target, *config_.max_step);
  if (config_.dense) {  // the newest step at or below it with a dense state every rank can end at
    std::vector<int64_t> dense;
    for (auto& s : st)
      for (auto t : s.dense_steps)
        if (t <= target) dense.push_back(t);
    std::sort(dense.rbegin(), dense.rend());
    for (auto t : dense) {
      bool all = true;
      for (auto& s : st)
        if (!s.steps.empty() && std::find(s.steps.begin(), s.steps.end(), t) == s.steps.end())
          all = false;
      if (all) {
        target = t;
        break;
      }
    }
  }
  result.head_step = head;
  result.cap_step = cap;
  std::vector<std::optional<RankDelta>> got(ranks_.size());
  errs = parallel(ranks_.size(), [&](size_t i) { got[i] = get_delta(*ranks_[i], target); });
  for (size_t i = 0; i < errs.size(); ++i)
    if (errs[i]) result.missing[uint32_t(i)] = error_text(errs[i]);
  if (!result.missing.empty()) return result;
  std::set<uint64_t> dgens;
  std::set<int64_t> dsteps;
  for (auto& d : got) {
    dgens.insert(d->generation);
    dsteps.insert(d->to_step);
  }
  if (dgens.size() > 1 || dsteps.size() > 1) {
    for (auto& d : got) result.missing[d->rank] = "answered another step or generation";
    return result;
  }
  for (auto& d : got) result.deltas.push_back(std::move(*d));
  result.step = result.deltas.front().to_step;
  return result;
}

std::vector<uint32_t> Consumer::commit(const PullResult& result) {
  if (!connected_) throw ConsumerError("Consumer is not connected (connect() first)");
  std::vector<Rank*> todo;
  for (const auto& d : result.deltas) {
    Rank& r = *ranks_.at(d.rank);
    std::lock_guard<std::mutex> g(r.mu);
    if (d.resync) r.needs_base = false;  // applied: the caller holds this rank's tables
    if (d.committed) {
      r.committed = d.cursor;
      continue;
    }
    if (!(d.resync || d.rows > 0 || d.to_seq != d.from_seq)) continue;  // nothing moved
    r.pending = d.cursor;
    todo.push_back(&r);
  }
  std::vector<uint32_t> done;
  auto errs = parallel(todo.size(), [&](size_t i) { flush_pending(*todo[i]); });
  for (size_t i = 0; i < todo.size(); ++i) {
    std::lock_guard<std::mutex> g(todo[i]->mu);
    if (!errs[i] && !todo[i]->pending) done.push_back(todo[i]->rank);
  }
  return done;
}

void Consumer::request_base() {
  for (auto& r : ranks_) {
    std::lock_guard<std::mutex> g(r->mu);
    r->needs_base = true;
    r->pending.reset();  // the tables it described are not held any more
  }
}

bool Consumer::wait_for_new(double timeout_s, const std::atomic<bool>* stop) {
  if (!connected_) throw ConsumerError("Consumer is not connected (connect() first)");
  timeout_s = std::min(timeout_s, 86400.0);
  if (timeout_s <= 0) return true;
  for (auto& r : ranks_) {
    std::lock_guard<std::mutex> g(r->mu);
    if (r->needs_base && r->seen.second >= 0) return true;
  }
  size_t n = ranks_.size();
  std::vector<std::unique_ptr<grpc::ClientContext>> ctxs(n);
  std::vector<v1::StatusResponse> outs(n);
  std::vector<grpc::Status> sts(n);
  std::vector<std::pair<uint64_t, int64_t>> seen(n);
  std::vector<std::optional<uint64_t>> versions(n);
  std::mutex mu;
  std::condition_variable cv;
  size_t answered = 0;
  for (size_t i = 0; i < n; ++i) {
    ctxs[i] = std::make_unique<grpc::ClientContext>();
    auth_->decorate(*ctxs[i]);
    ctxs[i]->set_deadline(deadline_in(timeout_s + std::min(10.0, config_.rpc_deadline_s)));
    std::lock_guard<std::mutex> g(ranks_[i]->mu);
    seen[i] = ranks_[i]->seen;
    versions[i] = ranks_[i]->rollout_version;
  }
  std::vector<std::thread> threads;
  for (size_t i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      v1::StatusRequest req;
      req.set_after_generation(seen[i].first);
      req.set_after_seq(seen[i].second);
      req.set_wait_ms(uint32_t(timeout_s * 1000));
      if (versions[i]) req.set_after_rollout_version(*versions[i]);
      grpc::Status s = ranks_[i]->stub->Status(ctxs[i].get(), req, &outs[i]);
      std::lock_guard<std::mutex> g(mu);
      sts[i] = s;
      ++answered;
      cv.notify_all();
    });
  auto end = Clock::now() + std::chrono::microseconds(int64_t((timeout_s + 1.0) * 1e6));
  {
    std::unique_lock<std::mutex> lk(mu);
    while (answered == 0 && Clock::now() < end && !(stop && *stop))
      cv.wait_for(lk, std::chrono::milliseconds(100));
  }
  for (auto& c : ctxs) c->TryCancel();
  for (auto& t : threads) t.join();
  bool moved = false;
  for (size_t i = 0; i < n; ++i) {
    if (!sts[i].ok()) continue;
    const auto& s = outs[i];
    if (std::make_pair(uint64_t(s.generation()), int64_t(s.head_seq())) > seen[i]) moved = true;
    if (!s.rollout_state().empty() && versions[i] && *versions[i] != s.rollout_version())
      moved = true;
  }
  return moved;
}

}  // namespace deltad
