// deltad-predictor-cpp: the reference C++ predictor. It loads a TorchScript artifact
// (deltad export), bootstraps from deltad alone, follows the trainer, answers forwards on a
// thread while it applies, logs one JSON line per pull (as `deltad consume`), and on SIGTERM
// finishes its pull, commits and exits 0. SIGUSR1 writes its state to --final-state between
// pulls (a check of a running predictor). Bad input: one line on stderr, exit 2.
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "deltad/applier.h"
#include "deltad/consumer.h"

#ifndef DELTAD_FBGEMM_DIR
#define DELTAD_FBGEMM_DIR ""
#endif

namespace {

using Clock = std::chrono::steady_clock;
std::atomic<bool> g_stop{false};
std::atomic<bool> g_state_asked{false};

void on_signal(int) { g_stop = true; }
void on_state_signal(int) { g_state_asked = true; }

struct Args {
  deltad::ConsumerConfig consumer;
  std::string artifact, manifest, fbgemm_dir, final_state;
  std::string wire_dtype;
  double duration_s = 0, interval_s = 0.2, long_poll_s = 5.0, serve_interval_s = 0.002;
  int64_t pulls = 0, chunk_rows = 4096;
  double malloc_keep_mb = 128;  // deltad::tune_allocator (0: glibc's defaults)
  int apply_nice = 10;          // the pull / apply thread's nice (0: the process's)
  std::string bare_baseline;    // bench: "before" / "after" each apply, ModelApplier::bare_write
};

[[noreturn]] void die(const std::string& msg) {
  std::string line = msg.substr(0, msg.find('\n'));
  std::fprintf(stderr, "deltad-predictor-cpp: error: %s\n", line.c_str());
  std::fflush(stderr);
  std::_Exit(2);
}

const char* kUsage =
    "usage: deltad-predictor-cpp --sidecars HOST:PORT[,HOST:PORT...] --model M --consumer NAME\n"
    "         --artifact PATH [--manifest PATH (default PATH.json)] [--fbgemm-dir DIR]\n"
    "         [--form rows|topk] [--k N] [--wire-dtype fp32|fp16|bf16|int8|packed-int8|...]\n"
    "         [--no-dense] [--duration S] [--pulls N] [--interval S] [--long-poll S]\n"
    "         [--chunk-rows N] [--serve-interval S] [--rpc-deadline S] [--max-retries N]\n"
    "         [--token-file F] [--tls-ca F] [--tls-cert F --tls-key F] [--final-state PATH]\n"
    "         [--malloc-keep-mb N (128; 0: glibc's defaults)] [--apply-nice N (10)]\n"
    "         [--bare-baseline before|after (a benchmark's: unchecked writes)]\n"
    "  SIGTERM/SIGINT: finish the pull, commit, write --final-state, exit 0.\n"
    "  SIGUSR1: write --final-state between pulls, keep going.\n";

double number(const std::string& flag, const std::string& v, double lo, double hi) {
  char* end = nullptr;
  double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || !(x >= lo && x <= hi))
    die(flag + ": expected a number in [" + std::to_string(lo) + ", " + std::to_string(hi) +
        "], got '" + v + "'");
  return x;
}

Args parse(int argc, char** argv) {
  Args a;
  a.fbgemm_dir = std::getenv("DELTAD_FBGEMM_DIR") ? std::getenv("DELTAD_FBGEMM_DIR")
                                                  : DELTAD_FBGEMM_DIR;
  if (const char* t = std::getenv("DELTAD_TOKEN")) a.consumer.token = t;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "-h" || f == "--help") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (f == "--no-dense") {
      a.consumer.dense = false;
      continue;
    }
    if (i + 1 >= argc) die(f + ": expected a value (see --help)");
    std::string v = argv[++i];
    if (f == "--sidecars") {
      std::stringstream ss(v);
      std::string ep;
      while (std::getline(ss, ep, ','))
        if (!ep.empty()) a.consumer.sidecars.push_back(ep);
    } else if (f == "--model") {
      a.consumer.model = v;
    } else if (f == "--consumer") {
      a.consumer.consumer = v;
    } else if (f == "--artifact") {
      a.artifact = v;
    } else if (f == "--manifest") {
      a.manifest = v;
    } else if (f == "--fbgemm-dir") {
      a.fbgemm_dir = v;
    } else if (f == "--form") {
      if (v == "rows")
        a.consumer.form = deltad::Form::kRows;
      else if (v == "topk")
        a.consumer.form = deltad::Form::kTopk;
      else
        die("--form: rows or topk, not '" + v + "'");
    } else if (f == "--k") {
      a.consumer.k = uint64_t(number(f, v, 0, 1e15));
    } else if (f == "--wire-dtype") {
      a.wire_dtype = v;
    } else if (f == "--duration") {
      a.duration_s = number(f, v, 0, 1e9);
    } else if (f == "--pulls") {
      a.pulls = int64_t(number(f, v, 0, 1e15));
    } else if (f == "--interval") {
      a.interval_s = number(f, v, 0, 3600);
    } else if (f == "--long-poll") {
      a.long_poll_s = number(f, v, 0, 3600);
    } else if (f == "--chunk-rows") {
      a.chunk_rows = int64_t(number(f, v, 1, 1e12));
    } else if (f == "--serve-interval") {
      a.serve_interval_s = number(f, v, 0, 60);
    } else if (f == "--rpc-deadline") {
      a.consumer.rpc_deadline_s = number(f, v, 0.001, 86400);
    } else if (f == "--max-retries") {
      a.consumer.max_retries = int(number(f, v, 0, 1000));
    } else if (f == "--token-file") {
      a.consumer.token_file = v;
    } else if (f == "--tls-ca") {
      a.consumer.tls_ca = v;
    } else if (f == "--tls-cert") {
      a.consumer.tls_cert = v;
    } else if (f == "--tls-key") {
      a.consumer.tls_key = v;
    } else if (f == "--final-state") {
      a.final_state = v;
    } else if (f == "--bare-baseline") {
      if (v != "before" && v != "after") die("--bare-baseline: before or after, not '" + v + "'");
      a.bare_baseline = v;
    } else if (f == "--apply-nice") {
      a.apply_nice = int(number(f, v, 0, 19));
    } else if (f == "--malloc-keep-mb") {
      a.malloc_keep_mb = number(f, v, 0, 1024);
    } else {
      die("unknown flag " + f + " (see --help)");
    }
  }
  if (a.consumer.sidecars.empty()) die("--sidecars is required");
  if (a.consumer.consumer.empty()) die("--consumer is required");
  if (a.artifact.empty()) die("--artifact is required");
  if (a.manifest.empty()) a.manifest = a.artifact + ".json";
  if (a.fbgemm_dir.empty()) die("--fbgemm-dir (or DELTAD_FBGEMM_DIR) is required");
  return a;
}

std::string quote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += char(ch);
    } else if (ch < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", ch);
      out += buf;
    } else {
      out += char(ch);
    }
  }
  return out + "\"";
}

template <class T>
std::string opt(const std::optional<T>& v) {
  return v ? std::to_string(*v) : "null";
}

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void emit(const std::string& line) {
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

void write_final_state(deltad::ModelApplier& applier, const std::string& path) {
  auto state = applier.state();
  state.insert("forward", applier.forward_example());
  std::vector<char> bytes = torch::jit::pickle_save(c10::IValue(state));
  std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::binary);
    if (!f) throw deltad::ConfigError("cannot write --final-state " + path);
    f.write(bytes.data(), std::streamsize(bytes.size()));
    if (!f) throw deltad::ConfigError("cannot write --final-state " + path);
  }
  std::filesystem::rename(tmp, path);
}

// SIGUSR1: the state as it is between pulls (tables, buffers, dense, forward), written where
// --final-state says, then one line {"event":"state",...}; without --final-state, a line saying so
void write_asked_state(deltad::ModelApplier& applier, const std::string& path,
                       const std::string& consumer, std::optional<int64_t> step) {
  if (!g_state_asked.exchange(false)) return;
  std::string error;
  if (path.empty()) {
    error = "no --final-state to write to";
  } else {
    try {
      write_final_state(applier, path);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  emit("{\"event\":\"state\",\"consumer\":" + quote(consumer) + ",\"t\":" +
       std::to_string(unix_now()) + ",\"step\":" + opt(step) + ",\"path\":" + quote(path) +
       (error.empty() ? "" : ",\"error\":" + quote(error)) + "}");
}

}  // namespace

int main(int argc, char** argv) {
  Args args = parse(argc, argv);
  deltad::tune_allocator(size_t(args.malloc_keep_mb * (1 << 20)));
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  struct sigaction su {};
  su.sa_handler = on_state_signal;
  sigaction(SIGUSR1, &su, nullptr);

  std::unique_ptr<deltad::ModelApplier> applier;
  std::unique_ptr<deltad::Consumer> consumer;
  bool tables_checked = false;
  try {
    deltad::load_fbgemm(args.fbgemm_dir);
    if (!std::filesystem::is_regular_file(args.artifact))
      die("artifact " + args.artifact + " not found");
    torch::jit::Module module;
    try {
      module = torch::jit::load(args.artifact);
    } catch (const c10::Error& e) {
      die("cannot load artifact " + args.artifact + ": " + e.what_without_backtrace());
    }
    auto manifest = deltad::Manifest::load(args.manifest);
    applier = std::make_unique<deltad::ModelApplier>(std::move(module), manifest, args.chunk_rows);
    if (args.wire_dtype.empty()) {  // the tables' own row layout when they share one
      std::string dt = manifest.tables.empty() ? "fp32" : manifest.tables[0].dtype;
      for (const auto& t : manifest.tables)
        if (t.dtype != dt) dt = "fp32";
      args.wire_dtype = dt == "int8" ? "packed-int8" : dt == "int4" ? "packed-int4"
                        : dt == "fp16" ? "packed-fp16" : "fp32";
    }
    args.consumer.wire_dtype = deltad::wire_dtype_of(args.wire_dtype);
    consumer = std::make_unique<deltad::Consumer>(args.consumer);
    consumer->connect();
    std::vector<deltad::TableInfo> served;
    for (const auto& st : consumer->status())
      served.insert(served.end(), st.tables.begin(), st.tables.end());
    if (!served.empty()) {  // (nothing published yet: checked before the first apply)
      applier->check_tables(served);
      tables_checked = true;
    }
    // the artifact answers before anything is applied; and TorchScript's profiling executor
    // optimizes a graph over its first runs (slow ones, holding the serving lock): warm up
    // before the first window, not while a chunk waits for them
    for (int i = 0; i < 3; ++i) applier->forward_example();
  } catch (const deltad::ConsumerError& e) {
    die(e.what());
  } catch (const c10::Error& e) {
    die(e.what_without_backtrace());
  } catch (const std::exception& e) {
    die(e.what());
  }

  // forwards on a thread, all along
  std::atomic<bool> stop_forwards{false}, applying{false}, pulling{false};
  std::atomic<uint64_t> forwards{0};
  std::string forward_error;
  // forward latencies (seconds; the newest kMaxSamples), split by an apply in progress or not
  constexpr size_t kMaxSamples = 200000;
  // (idle: no apply in flight; quiet: neither a pull nor an apply in flight)
  std::vector<double> idle_s, apply_s_samples, quiet_s;
  std::thread fwd([&] {
    try {
      while (!stop_forwards) {
        bool during = applying, busy = pulling || during;
        auto f0 = Clock::now();
        applier->forward_example();
        double dt = std::chrono::duration<double>(Clock::now() - f0).count();
        auto& into = (during || applying) ? apply_s_samples : idle_s;
        if (into.size() >= kMaxSamples) into.erase(into.begin(), into.begin() + kMaxSamples / 2);
        into.push_back(dt);
        if (!busy && !pulling && !applying) {
          if (quiet_s.size() >= kMaxSamples)
            quiet_s.erase(quiet_s.begin(), quiet_s.begin() + kMaxSamples / 2);
          quiet_s.push_back(dt);
        }
        ++forwards;
        auto until = Clock::now() + std::chrono::microseconds(int64_t(args.serve_interval_s * 1e6));
        while (!stop_forwards && Clock::now() < until)  // (a long interval ends at exit)
          std::this_thread::sleep_for(std::min<Clock::duration>(until - Clock::now(),
                                                                std::chrono::milliseconds(20)));
      }
    } catch (const std::exception& e) {
      forward_error = e.what();
    }
  });

  auto started = Clock::now();
  int64_t n = 0, applied = 0, refused = 0;
  uint64_t rows_total = 0, bytes_total = 0;
  double backoff = 0.1;
  std::optional<int64_t> last_step;
  int exit_code = 0;
  auto nap = [&](double s) {
    auto end = Clock::now() + std::chrono::microseconds(int64_t(s * 1e6));
    while (!g_stop && Clock::now() < end) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  };
  // pulls and applies on their own thread at a lower CPU priority (--apply-nice): a forward
  // competes with them for the cores only when nothing else wants them (the thread and the
  // intra-op threads its packing starts are created after the nice, so they share it)
  std::thread updater([&] {
  if (args.apply_nice > 0) setpriority(PRIO_PROCESS, pid_t(syscall(SYS_gettid)), args.apply_nice);
  while (!g_stop) {
    pulling = false;
    write_asked_state(*applier, args.final_state, args.consumer.consumer, last_step);
    if (args.pulls && n >= args.pulls) break;
    double elapsed = std::chrono::duration<double>(Clock::now() - started).count();
    if (args.duration_s > 0 && elapsed >= args.duration_s) break;
    ++n;
    auto t0 = Clock::now();
    deltad::PullResult result;
    pulling = true;  // until the window is applied or dropped (forwards: not quiet)
    try {
      result = consumer->pull();
    } catch (const deltad::ConfigError& e) {
      std::fprintf(stderr, "deltad-predictor-cpp: error: %s\n", e.what());
      exit_code = 2;
      break;
    } catch (const std::exception& e) {
      emit(std::string("{\"event\":\"error\",\"consumer\":") + quote(args.consumer.consumer) +
           ",\"t\":" + std::to_string(unix_now()) + ",\"pull\":" + std::to_string(n) +
           ",\"error\":" + quote(e.what()) + "}");
      nap(backoff);
      backoff = std::min(backoff * 2, 5.0);
      continue;
    }
    double pull_s = std::chrono::duration<double>(Clock::now() - t0).count();
    double apply_s = 0;
    std::optional<double> bare_s;
    deltad::ApplyStats stats;
    std::string error;
    bool resync = false, gen_diff = false;
    uint64_t owed = 0, dense_bytes = 0, evicted = 0;
    std::optional<int64_t> dense_step, rollback_to;
    for (const auto& d : result.deltas) {
      resync = resync || d.resync;
      gen_diff = gen_diff || d.generation_diff.has_value();
      owed += d.owed();
      for (const auto& sl : d.slices) evicted += sl.evicted.size();
      dense_bytes += d.dense_bytes;
      if (d.dense_step) dense_step = d.dense_step;
      if (d.rollback_to) rollback_to = d.rollback_to;
    }
    if (!result.deltas.empty() && !tables_checked) {
      try {
        std::vector<deltad::TableInfo> served;
        for (const auto& st : consumer->status())
          served.insert(served.end(), st.tables.begin(), st.tables.end());
        applier->check_tables(served);
        tables_checked = true;
      } catch (const deltad::ConfigError& e) {
        std::fprintf(stderr, "deltad-predictor-cpp: error: %s\n", e.what());
        exit_code = 2;
        break;
      } catch (const std::exception& e) {
        nap(backoff);  // (the sidecars did not answer: the window comes again)
        continue;
      }
    }
    if (!result.deltas.empty()) {
      auto t1 = Clock::now();
      try {
        if (args.bare_baseline == "before") bare_s = applier->bare_write(result.deltas);
        t1 = Clock::now();
        applying = true;
        stats = applier->apply(result.deltas);
        applying = false;
        apply_s = std::chrono::duration<double>(Clock::now() - t1).count();
        if (args.bare_baseline == "after") bare_s = applier->bare_write(result.deltas);
        consumer->commit(result);
        ++applied;
        last_step = result.step;
        backoff = 0.1;
      } catch (const std::exception& e) {
        applying = false;
        // nothing of the window was applied: say so once, ask for the full tables, back off
        error = e.what();
        ++refused;
        std::fprintf(stderr, "deltad-predictor-cpp: window not applied (asking for a rebase): %s\n",
                     error.c_str());
        std::fflush(stderr);
        consumer->request_base();
      }
    }
    pulling = false;
    rows_total += result.rows();
    bytes_total += result.bytes();
    std::string missing = "{";
    for (const auto& [rank, why] : result.missing)
      missing += (missing.size() > 1 ? "," : "") + quote(std::to_string(rank)) + ":" + quote(why);
    missing += "}";
    std::ostringstream line;
    line << "{\"event\":\"pull\",\"consumer\":" << quote(args.consumer.consumer)
         << ",\"t\":" << std::to_string(unix_now()) << ",\"pull\":" << n
         << ",\"step\":" << opt(error.empty() ? result.step : std::optional<int64_t>())
         << ",\"head_step\":" << opt(result.head_step) << ",\"rows\":" << result.rows()
         << ",\"bytes\":" << result.bytes() << ",\"owed\":" << owed
         << ",\"evicted\":" << evicted
         << ",\"resync\":" << (resync ? "true" : "false")
         << ",\"generation_diff\":" << (gen_diff ? "true" : "false") << ",\"missing\":" << missing
         << ",\"pull_s\":" << pull_s << ",\"apply_s\":" << apply_s
         << ",\"pack_s\":" << stats.pack_s << ",\"write_s\":" << stats.write_s
         << ",\"chunks\":" << stats.chunks
         << ",\"bare_write_s\":" << (bare_s ? std::to_string(*bare_s) : "null")
         << ",\"dense_bytes\":" << dense_bytes << ",\"dense_step\":" << opt(dense_step)
         << ",\"rollback_to\":" << opt(rollback_to) << ",\"cap_step\":" << opt(result.cap_step)
         << ",\"applied\":" << (error.empty() && !result.deltas.empty() ? "true" : "false")
         << ",\"forwards\":" << forwards.load();
    if (!error.empty()) line << ",\"error\":" << quote(error);
    line << "}";
    emit(line.str());
    if (!error.empty()) {
      nap(backoff);
      backoff = std::min(backoff * 2, 5.0);
    } else if (!result.missing.empty()) {
      nap(std::max(args.interval_s, 0.05));
    } else if (result.rows() == 0 && owed == 0) {
      if (args.long_poll_s > 0) {
        try {
          if (!consumer->wait_for_new(args.long_poll_s, &g_stop)) nap(args.interval_s);
        } catch (const std::exception&) {
          nap(args.interval_s);
        }
      } else {
        nap(args.interval_s);
      }
    }
  }
  pulling = false;
  });
  updater.join();
  stop_forwards = true;
  fwd.join();
  if (!args.final_state.empty()) {
    try {
      write_final_state(*applier, args.final_state);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "deltad-predictor-cpp: error: %s\n", e.what());
      exit_code = 2;
    }
  }
  auto p99_ms = [](std::vector<double> v) -> std::string {
    if (v.empty()) return "null";
    size_t k = std::min(v.size() - 1, size_t(0.99 * double(v.size())));
    std::nth_element(v.begin(), v.begin() + long(k), v.end());
    return std::to_string(v[k] * 1000);
  };
  std::ostringstream sum;
  sum << "{\"event\":\"summary\",\"consumer\":" << quote(args.consumer.consumer)
      << ",\"t\":" << std::to_string(unix_now()) << ",\"pulls\":" << n
      << ",\"applied\":" << applied << ",\"refused\":" << refused << ",\"rows\":" << rows_total
      << ",\"bytes\":" << bytes_total << ",\"step\":" << opt(last_step)
      << ",\"forwards\":" << forwards.load() << ",\"forwards_during_apply\":"
      << apply_s_samples.size() << ",\"forward_p99_idle_ms\":" << p99_ms(idle_s)
      << ",\"forward_p99_apply_ms\":" << p99_ms(apply_s_samples)
      << ",\"forwards_quiet\":" << quiet_s.size()
      << ",\"forward_p99_quiet_ms\":" << p99_ms(quiet_s)
      << ",\"forward_error\":" << (forward_error.empty() ? "null" : quote(forward_error)) << "}";
  emit(sum.str());
  consumer->close();
  if (!forward_error.empty() && exit_code == 0) exit_code = 1;
  return exit_code;
}
