// deltad-pull-bench: the C++ client's pull against a bare C++ gRPC stream of the same bytes,
// in one run (bench/cpp_apply.py runs it; bench/README.md records the ratio).
//
// Each repeat, alternating: (bare) Register, then one GetDelta stream of the whole tables
// (from_base, the same dtype, row alignment and chunking as the client asks for), every
// message read into one reused response and dropped; (client) a fresh deltad::Consumer's
// connect, then its pull() of the same window timed: Status, the stream, the decode into
// RankDeltas (no apply, no commit). Prints one JSON object with the medians and the ratio.
// The allocator is tuned as deltad-predictor-cpp tunes it (DELTAD_MALLOC_KEEP_MB, default 128).
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "deltad/consumer.h"
#include "deltad/v1/delta.grpc.pb.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "deltad-pull-bench: error: %s\n", msg.c_str());
  std::exit(2);
}

// One bare stream: (seconds, bytes of the messages as received).
std::pair<double, uint64_t> bare_stream(deltad::v1::DeltaService::Stub& stub,
                                        const std::string& consumer, deltad::WireDtype dtype) {
  namespace v1 = deltad::v1;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::RegisterRequest req;
    req.set_consumer(consumer);
    req.set_lease_ttl_seconds(60);
    v1::RegisterResponse out;
    grpc::Status s = stub.Register(&ctx, req, &out);
    if (!s.ok()) die("Register: " + s.error_message());
  }
  v1::GetDeltaRequest req;
  req.set_consumer(consumer);
  req.set_form(v1::FORM_ROWS);
  req.set_dtype(static_cast<v1::WireDtype>(int(dtype)));
  req.set_auto_commit(false);
  req.set_from_base(true);
  req.set_with_dense(false);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
  auto t0 = Clock::now();
  auto reader = stub.GetDelta(&ctx, req);
  v1::GetDeltaResponse msg;
  uint64_t bytes = 0;
  while (reader->Read(&msg)) bytes += msg.ByteSizeLong();
  grpc::Status s = reader->Finish();
  double dt = seconds_since(t0);
  if (!s.ok()) die("GetDelta: " + s.error_message());
  return {dt, bytes};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || std::string(argv[1]) == "--help")
    die("usage: deltad-pull-bench HOST:PORT MODEL [REPEAT (3)] [WIRE_DTYPE (packed-int8)]");
  std::string target = argv[1], model = argv[2];
  int repeat = argc > 3 ? std::atoi(argv[3]) : 3;
  deltad::WireDtype dtype = deltad::wire_dtype_of(argc > 4 ? argv[4] : "packed-int8");
  if (repeat < 1 || repeat > 100) die("REPEAT: 1..100");
  // as deltad-predictor-cpp runs (its --malloc-keep-mb default); DELTAD_MALLOC_KEEP_MB=0: glibc's
  const char* keep = std::getenv("DELTAD_MALLOC_KEEP_MB");
  size_t keep_mb = keep ? size_t(std::atoll(keep)) : 128;
  deltad::tune_allocator(keep_mb << 20);
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  auto stub = deltad::v1::DeltaService::NewStub(channel);
  std::vector<double> bare_s, client_s;
  uint64_t bare_bytes = 0, client_bytes = 0, rows = 0;
  for (int i = 0; i < repeat; ++i) {
    auto [dt, b] = bare_stream(*stub, "pull-bench-bare-" + std::to_string(i), dtype);
    bare_s.push_back(dt);
    bare_bytes = b;
    deltad::ConsumerConfig cfg;
    cfg.consumer = "pull-bench-client-" + std::to_string(i);
    cfg.model = model;
    cfg.sidecars = {target};
    cfg.wire_dtype = dtype;
    cfg.dense = false;
    deltad::Consumer c(cfg);
    c.connect();
    auto t0 = Clock::now();
    deltad::PullResult r = c.pull();
    client_s.push_back(seconds_since(t0));
    if (!r.missing.empty() || r.deltas.empty()) die("the client's pull missed a rank");
    client_bytes = r.bytes();
    rows = r.rows();
    c.close();
  }
  double bare = median(bare_s), client = median(client_s);
  std::printf(
      "{\"repeat\": %d, \"rows\": %llu, \"bare_stream_s\": %.6f, \"bare_stream_bytes\": %llu, "
      "\"client_pull_s\": %.6f, \"client_bytes\": %llu, \"client_vs_bare\": %.4f, "
      "\"malloc_keep_mb\": %zu, \"bare_stream_all_s\": [",
      repeat, (unsigned long long)rows, bare, (unsigned long long)bare_bytes, client,
      (unsigned long long)client_bytes, bare / client, keep_mb);
  for (size_t i = 0; i < bare_s.size(); ++i) std::printf("%s%.6f", i ? ", " : "", bare_s[i]);
  std::printf("], \"client_pull_all_s\": [");
  for (size_t i = 0; i < client_s.size(); ++i) std::printf("%s%.6f", i ? ", " : "", client_s[i]);
  std::printf("]}\n");
  return 0;
}
