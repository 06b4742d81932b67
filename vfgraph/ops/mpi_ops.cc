// MPI collective operations for TensorFlow graphs.
//
// Ops: VfAllreduce, VfBroadcast, VfBroadcastVariables, VfAllgather, VfCheck, VfRank,
// VfSize; VfSend and VfRecv (point to point, between pipeline stages); VfExactAdd (no
// MPI: a virtual node's values added to exact fixed-point sums, for deterministic mode).
//
// Every kernel runs its collective on one process-global communicator
// (MPI_COMM_WORLD unless vf_mpi_set_comm chose another), under one process-global
// mutex, so that collectives issued by concurrently running kernels of one process
// never overlap. The order of collectives across ranks is the graph's business
// (control dependencies); the library never initialises or finalises MPI: mpi4py
// owns MPI_Init and MPI_Finalize.
//
// VfAllreduce and VfAllgather first wait for every rank to arrive by polling a
// nonblocking barrier (backing off as the wait grows), then move the data with a polled
// nonblocking collective, testing it back to back for a while: every rank is there, so the
// wait is MPI's own work, whose rounds each need every rank's progress (a rank asleep between
// tests would hold up the others at every round). A rank that waits for a slower one (uneven
// hardware, an uneven share of the virtual nodes) thus leaves the CPU to others instead of
// spinning in MPI, and the data moves at MPI's speed. The
// time each process spends in collectives is counted (vf_mpi_blocked_ns), so the
// runtime can tell a rank's own computing from its wait for the others.
//
// Every wait is watched (Await): it backs off, gives up on a stop request (SIGINT, SIGTERM),
// on TensorFlow's cancellation or after the stall timeout, and past the stall warning prints
// one line naming what it waits for and the ranks it waits for (vf_mpi_watch).
//
// VfSend and VfRecv are asynchronous kernels: each message is waited for on a thread
// of its own (a send is posted first, on the op's thread, so that it leaves at once),
// outside the collective mutex, matched by its tag, so a stage
// waiting for a gradient never keeps the rest of the step from running (and the
// order in which concurrent iterations post them does not matter). They wait by
// polling nonblocking calls: a blocking MPI call can hold the MPI library's own lock
// while it waits, which would stop every other thread's MPI call, the other
// messages' among them. A message's thread runs at the lowest priority (SCHED_IDLE) and
// tests its request between yields: it takes the CPU only when nothing else of the host
// wants it, so it sees a message the moment the stage has nothing else to do, and never
// preempts the stage's computing; while any message is in flight, one thread of normal
// priority keeps MPI's progress going every millisecond (MessageWait), so a send whose
// transport needs this rank's progress goes on while the stage computes.

#include <mpi.h>
#include <signal.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <chrono>
#include <thread>
#include <sched.h>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tensorflow/core/framework/cancellation.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/util/work_sharder.h"

namespace vfgraph {
namespace {

using ::tensorflow::AsyncOpKernel;
using ::tensorflow::DataType;
using ::tensorflow::DataTypeString;
using ::tensorflow::OpKernel;
using ::tensorflow::OpKernelConstruction;
using ::tensorflow::OpKernelContext;
using ::tensorflow::Tensor;
using ::tensorflow::TensorShape;
namespace shape_inference = ::tensorflow::shape_inference;

// Largest element or byte count handed to one MPI call (MPI counts are int).
constexpr int64_t kMaxCount = int64_t{1} << 30;

// Bytes of the fingerprint record VfCheck compares across ranks.
constexpr int kFingerprintBytes = 64;

// ---------------------------------------------------------------------------
// Process-global state: the communicator, the collective mutex, the 16-bit types.

std::mutex& CollectiveMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

struct CommState {
  bool user_comm = false;        // vf_mpi_set_comm chose a communicator
  MPI_Comm comm = MPI_COMM_NULL;  // that communicator
  bool errhandler_set = false;   // MPI_ERRORS_RETURN installed on the one in use
  int stages = 0;                 // vf_mpi_split_stages split it into this many stages
  MPI_Comm stage_comm = MPI_COMM_NULL;  // this rank's stage: the ranks equal to it modulo stages
  MPI_Comm replica_comm = MPI_COMM_NULL;  // this rank's replica: its group of `stages` consecutive ranks
  int64_t seq = 0;                // collectives run on `comm` so far (numbers them for the watchdog)
  int64_t stage_seq = 0;          // and on `stage_comm`
  int64_t replica_seq = 0;        // and on `replica_comm`
};

CommState& State() {
  static CommState* state = new CommState;
  return *state;
}

// MPI has no 16-bit floating-point types: half and bfloat16 travel as opaque
// 2-byte datatypes, summed by user-defined operations that add through float.
struct HalfTypes {
  bool made = false;
  MPI_Datatype half = MPI_DATATYPE_NULL;
  MPI_Datatype bfloat16 = MPI_DATATYPE_NULL;
  MPI_Op half_sum = MPI_OP_NULL;
  MPI_Op bfloat16_sum = MPI_OP_NULL;
};

HalfTypes& Halves() {
  static HalfTypes* types = new HalfTypes;
  return *types;
}

template <typename T>
void SumThroughFloat(void* in, void* inout, int* len, MPI_Datatype* /*type*/) {
  const T* a = static_cast<const T*>(in);
  T* b = static_cast<T*>(inout);
  const int n = *len;
  for (int i = 0; i < n; ++i) {
    b[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
}

// Set while the job has lost a rank (vf_mpi_abandon): a wait for the others then gives up,
// since a rank that ended will never arrive, and the op fails with kAbandoned. The request
// waited for is left behind with its communicator, which the job no longer uses.
std::atomic<bool>& Abandoned() {
  static std::atomic<bool>* abandoned = new std::atomic<bool>(false);
  return *abandoned;
}
constexpr int kAbandoned = -1000;  // not an MPI error code

// Time this process has spent in collectives (from taking the collective mutex to the
// call's end), in nanoseconds: a step's time less this is the rank's own computing,
// which tells a slow rank from one that waits for it (vf_mpi_blocked_ns).
std::atomic<int64_t>& BlockedNanos() {
  static std::atomic<int64_t>* nanos = new std::atomic<int64_t>(0);
  return *nanos;
}

// What VfAllreduce spent its time on, summed over its calls (vf_mpi_allreduce_stats): the
// benchmarks read it to tell the reduction's own time inside a step from the rest.
struct AllreduceStats {
  std::atomic<int64_t> calls{0};
  std::atomic<int64_t> total_ns{0};    // from the kernel's start to its end
  std::atomic<int64_t> copy_ns{0};     // copying an input it could not reduce in place
  std::atomic<int64_t> arrive_ns{0};   // waiting for every rank to arrive (the barrier, where there is one)
  std::atomic<int64_t> reduce_ns{0};   // the reduction's own calls and waits
  std::atomic<int64_t> bytes{0};
  // Every wait of the ops (Await): tests of its request, yields, sleeps and the time asleep.
  std::atomic<int64_t> tests{0};
  std::atomic<int64_t> yields{0};
  std::atomic<int64_t> sleeps{0};
  std::atomic<int64_t> slept_ns{0};
};

AllreduceStats& Stats() {
  static AllreduceStats* stats = new AllreduceStats;
  return *stats;
}

// Adds the time from its construction to its destruction to BlockedNanos().
class BlockedClock {
 public:
  ~BlockedClock() {
    BlockedNanos() += std::chrono::duration_cast<std::chrono::nanoseconds>(
                          std::chrono::steady_clock::now() - start_).count();
  }

 private:
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

// The rank's view of the communicator in use, obtained under the mutex.
struct Comm {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = -1;
  int size = 0;
};

// ---------------------------------------------------------------------------
// Waiting for other ranks: every wait of the ops polls its request (Await), and as it
// polls it backs off (tests back to back for its first 50 us, so that a wait a peer ends
// within MPI's own latency ends as soon as MPI's; then yields between tests up to the first
// millisecond, then sleeps an eighth of the time waited so far, at most 1 ms: a stalled rank
// leaves its core to others), gives up when
// the job lost a rank (vf_mpi_abandon), when a stop was requested (SIGINT, SIGTERM:
// vf_mpi_watch) and the wait went on for the stop's grace time after it, when TensorFlow cancels
// the op, and when it made no progress for the stall timeout; past the stall warning it
// prints one line naming what it waits for and whom. A collective's wait names the ranks
// not seen entering it: a rank whose wait in a collective passes kAnnounceNs (or a quarter
// of the warning) announces the collective's number to the other ranks of its
// communicator, on a duplicate of it made (nonblocking) with its first collective (a
// message nobody received is left there: MPICH's finalization can trip over one left on
// MPI_COMM_WORLD and kill the job at its end); the ranks that waited that long are in
// it, the others are not (or came within that time).

constexpr int kStopped = -1001;    // a stop was requested: not an MPI error code
constexpr int kCancelled = -1002;  // TensorFlow cancelled the op
constexpr int kStalled = -1003;    // the stall timeout passed, here or in another wait of this rank
constexpr int64_t kAnnounceNs = 1'000'000'000;
constexpr int64_t kBusyNs = 50'000;    // tests back to back: a peer due within MPI's own latency
constexpr int64_t kTogetherBusyNs = 500'000;  // the same once every rank is known to be there
constexpr int64_t kSpinNs = 1'000'000;  // then tests between yields
constexpr int64_t kMaxSleepNs = 1'000'000;

int64_t MonotonicNs() {  // CLOCK_MONOTONIC, as steady_clock; async-signal-safe
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

struct WatchState {
  std::atomic<int64_t> warning_ns{0};  // 0: no warning (until vf_mpi_watch sets one)
  std::atomic<int64_t> timeout_ns{0};  // 0: no timeout
  std::atomic<int64_t> grace_ns{2'000'000'000};    // how long a wait goes on after a stop request
  std::atomic<int64_t> step{-1};                    // the training step, where known
  std::atomic<int64_t> stop_at{0};                  // MonotonicNs() of the first stop request
  std::atomic<int> halt{0};                         // kStopped or kStalled: every wait gives up
  std::atomic<int> waiting{0};                      // waits in progress
  std::atomic<bool> warned{false};                  // a wait printed its line since the last progress
  std::mutex mu;                                    // guards stall_line
  std::string stall_line;                           // why the first wait that stalled gave up
};

WatchState& Watch() {
  static WatchState* state = new WatchState;
  return *state;
}

// What the calling thread waits for, for the watchdog's line (set by a Watching).
struct Waited {
  const char* op = "";
  std::string node;
  int peer = -1;  // a message: its tag, and the rank it comes from or goes to
  int tag = -1;
  bool send = false;
  MPI_Comm comm = MPI_COMM_NULL;  // a collective: its communicator and number in it
  int rank = -1;
  int size = 0;
  int64_t seq = -1;
  ::tensorflow::CancellationManager* cancel = nullptr;
  bool announced = false;
};

thread_local Waited* current_wait = nullptr;

// Makes `waited` what the calling thread's waits are for, for its lifetime.
class Watching {
 public:
  explicit Watching(Waited waited) : waited_(std::move(waited)), outer_(current_wait) { current_wait = &waited_; }
  ~Watching() { current_wait = outer_; }

 private:
  Waited waited_;
  Waited* outer_;
};

// The announcements' duplicates of the collectives' communicators, by communicator (until
// vf_mpi_set_comm chooses another: the old ones are kept, with any message in them, until
// MPI_Finalize frees those every rank made).
struct Channel {
  MPI_Comm comm = MPI_COMM_NULL;
  MPI_Request made = MPI_REQUEST_NULL;
  bool ready = false;
};

std::mutex& ChannelMutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

std::map<MPI_Comm, Channel*>& Channels() {
  static std::map<MPI_Comm, Channel*>* channels = new std::map<MPI_Comm, Channel*>;
  return *channels;
}

std::vector<std::unique_ptr<Channel>>& AllChannels() {
  static std::vector<std::unique_ptr<Channel>>* all = new std::vector<std::unique_ptr<Channel>>;
  return *all;
}

// Whether every rank made `c` (the caller holds ChannelMutex()).
bool Made(Channel& c) {
  if (!c.ready && c.made != MPI_REQUEST_NULL) {
    int flag = 0;
    if (MPI_Test(&c.made, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && flag) c.ready = true;
  }
  return c.ready;
}

// At the start of MPI_Finalize (which deletes MPI_COMM_SELF's attributes first): frees the
// duplicates every rank made, so that no communicator is left referring to the job's own.
int FreeChannels(MPI_Comm, int, void*, void*) {
  std::lock_guard<std::mutex> lock(ChannelMutex());
  for (auto& c : AllChannels()) {
    if (Made(*c)) MPI_Comm_free(&c->comm);
  }
  AllChannels().clear();
  Channels().clear();
  return MPI_SUCCESS;
}

// Starts duplicating `comm` for its announcements, with its first collective (under the
// collective mutex: every rank makes the call at the same place among its collectives).
void OpenChannel(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(ChannelMutex());
  if (Channels().count(comm)) return;
  if (AllChannels().empty()) {
    int key = MPI_KEYVAL_INVALID;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, FreeChannels, &key, nullptr) == MPI_SUCCESS) {
      MPI_Comm_set_attr(MPI_COMM_SELF, key, nullptr);
    }
  }
  AllChannels().push_back(std::make_unique<Channel>());
  Channel* c = AllChannels().back().get();
  Channels()[comm] = c;
  if (MPI_Comm_idup(comm, &c->comm, &c->made) != MPI_SUCCESS) {
    c->made = MPI_REQUEST_NULL;  // never ready: its waits name no rank
  }
}

// The duplicate of `comm` once every rank made it, else MPI_COMM_NULL.
MPI_Comm ReadyChannel(MPI_Comm comm) {
  std::lock_guard<std::mutex> lock(ChannelMutex());
  auto it = Channels().find(comm);
  if (it == Channels().end()) return MPI_COMM_NULL;
  return Made(*it->second) ? it->second->comm : MPI_COMM_NULL;
}

// The collective's Waited: numbered in its communicator (`counter`), under the collective mutex.
Waited Collective(const char* op, const std::string& node, const Comm& comm, int64_t* counter,
                  OpKernelContext* context) {
  Waited w;
  w.op = op;
  w.node = node;
  w.comm = comm.comm;
  w.rank = comm.rank;
  w.size = comm.size;
  w.seq = (*counter)++;
  w.cancel = context->cancellation_manager();
  OpenChannel(w.comm);
  return w;
}

// The counter of collectives of the communicator of `stages` (AcquireComm).
int64_t* Counter(int stages) { return stages > 0 ? &State().stage_seq : &State().seq; }

// A message's Waited.
Waited Message(const char* op, const std::string& node, int peer, int tag, bool send, OpKernelContext* context) {
  Waited w;
  w.op = op;
  w.node = node;
  w.peer = peer;
  w.tag = tag;
  w.send = send;
  w.cancel = context->cancellation_manager();
  return w;
}

int AnnounceTag() {
  void* attr = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &attr, &found);
  return found ? *static_cast<int*>(attr) : 32767;
}

// Tells the other ranks of the collective's communicator that this one is in it.
void Announce(Waited* w) {
  static std::deque<int64_t>* sent = new std::deque<int64_t>;  // buffers of sends left to complete
  const MPI_Comm channel = ReadyChannel(w->comm);
  if (channel == MPI_COMM_NULL) return;  // (tried again as the wait polls)
  w->announced = true;
  sent->push_back(w->seq);
  for (int r = 0; r < w->size; ++r) {
    if (r == w->rank) continue;
    MPI_Request request;
    if (MPI_Isend(&sent->back(), 1, MPI_INT64_T, r, AnnounceTag(), channel, &request) == MPI_SUCCESS) {
      MPI_Request_free(&request);
    }
  }
}

// The ranks of the collective's communicator not seen in collective `w.seq`, by their
// rank in the communicator the ops use (a pipeline stage's communicator is translated).
std::vector<int> Missing(const Waited& w) {
  static std::map<MPI_Comm, std::vector<int64_t>>* seen = new std::map<MPI_Comm, std::vector<int64_t>>;
  std::vector<int64_t>& last = (*seen)[w.comm];
  last.resize(w.size, -1);
  const MPI_Comm channel = ReadyChannel(w.comm);
  for (;;) {  // take every announcement that arrived
    int flag = 0;
    MPI_Status status;
    if (channel == MPI_COMM_NULL ||
        MPI_Iprobe(MPI_ANY_SOURCE, AnnounceTag(), channel, &flag, &status) != MPI_SUCCESS || !flag) {
      break;
    }
    int64_t seq = -1;
    MPI_Recv(&seq, 1, MPI_INT64_T, status.MPI_SOURCE, AnnounceTag(), channel, MPI_STATUS_IGNORE);
    if (status.MPI_SOURCE >= 0 && status.MPI_SOURCE < w.size) {
      last[status.MPI_SOURCE] = std::max(last[status.MPI_SOURCE], seq);
    }
  }
  std::vector<int> missing;
  for (int r = 0; r < w.size; ++r) {
    if (r != w.rank && last[r] < w.seq) missing.push_back(r);
  }
  const CommState& state = State();
  const MPI_Comm main = state.user_comm ? state.comm : MPI_COMM_WORLD;
  if (w.comm != main && !missing.empty()) {
    MPI_Group from, to;
    MPI_Comm_group(w.comm, &from);
    MPI_Comm_group(main, &to);
    std::vector<int> translated(missing.size());
    MPI_Group_translate_ranks(from, static_cast<int>(missing.size()), missing.data(), to, translated.data());
    MPI_Group_free(&from);
    MPI_Group_free(&to);
    missing = translated;
  }
  return missing;
}

// What a wait is in ("VfRecv (node 'n', step 3)", `step`: with the step) and what it waits
// for ("message tag 5 from rank 1", "rank 1 (not seen entering it)").
std::pair<std::string, std::string> Describe(const Waited* w, bool step) {
  if (w == nullptr) return {"vfgraph's MPI ops", "other ranks"};
  const int64_t at = Watch().step.load();
  std::string where = absl::StrCat(w->op, " (node '", w->node, "'", step && at >= 0 ? absl::StrCat(", step ", at) : "");
  if (w->peer >= 0) {
    return {absl::StrCat(where, ")"),
            absl::StrCat("message tag ", w->tag, w->send ? " to be taken by rank " : " from rank ", w->peer)};
  }
  if (w->seq < 0) return {absl::StrCat(where, ")"), "other ranks"};
  const std::vector<int> missing = Missing(*w);
  return {absl::StrCat(where, ", collective ", w->seq, " of its communicator)"),
          missing.empty() ? "other ranks (each one entered it: the data has not moved)"
                          : absl::StrCat(missing.size() > 1 ? "ranks " : "rank ", absl::StrJoin(missing, ", "),
                                         " (not seen entering it)")};
}

int OwnRank() {
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

void PrintLine(const std::string& text) {
  const std::string line = absl::StrCat("vfgraph: rank ", OwnRank(), ": ", text, "\n");
  fwrite(line.data(), 1, line.size(), stderr);
  fflush(stderr);
}

// Gives up on the wait: its line becomes the rank's stall (the first one only).
int Stall(const Waited* w, int64_t waited_ns) {
  WatchState& watch = Watch();
  std::lock_guard<std::mutex> lock(watch.mu);
  if (watch.stall_line.empty()) {
    const auto [where, what] = Describe(w, false);
    watch.stall_line = absl::StrCat(where, " waited ", waited_ns / 1'000'000'000, " s for ", what,
                                    " without progress (--stall-timeout ", watch.timeout_ns.load() / 1'000'000'000,
                                    ")");
  }
  watch.halt.store(kStalled);
  return kStalled;
}

// Waits for `request`, polling it (see above), for what the thread's Watching says.
int Await(MPI_Request* request, MPI_Status* status, int64_t busy_ns = kBusyNs) {
  WatchState& watch = Watch();
  Waited* w = current_wait;
  const int64_t start = MonotonicNs();
  bool warned = false;
  struct Count {
    std::atomic<int>& n;
    ~Count() { --n; }
  } count{watch.waiting};
  ++watch.waiting;
  for (;;) {
    int flag = 0;
    Stats().tests.fetch_add(1, std::memory_order_relaxed);
    const int rc = MPI_Test(request, &flag, status);
    if (rc != MPI_SUCCESS || flag) {
      if (warned || watch.warned.load(std::memory_order_relaxed)) watch.warned.store(false);  // progress
      return rc;
    }
    if (Abandoned().load()) return kAbandoned;
    if (const int halt = watch.halt.load()) return halt;
    const int64_t now = MonotonicNs();
    const int64_t waited = now - start;
    const int64_t stop_at = watch.stop_at.load();
    if (stop_at != 0 && now - std::max(stop_at, start) > watch.grace_ns.load()) {
      watch.halt.store(kStopped);
      return kStopped;
    }
    if (w != nullptr && w->cancel != nullptr && w->cancel->IsCancelled()) return kCancelled;
    const int64_t warning = watch.warning_ns.load(), timeout = watch.timeout_ns.load();
    if (w != nullptr && w->seq >= 0 && !w->announced &&
        waited > std::min(kAnnounceNs, warning > 0 ? warning / 4 : kAnnounceNs)) {
      Announce(w);
    }
    if (!warned && warning > 0 && waited > warning) {
      warned = true;
      if (!watch.warned.exchange(true)) {  // the first wait of a stall to pass the warning
        const auto [where, what] = Describe(w, true);
        PrintLine(absl::StrCat("waiting ", waited / 1'000'000'000, " s in ", where, " for ", what,
                             timeout > 0 ? absl::StrCat("; the job ends after --stall-timeout ",
                                                        timeout / 1'000'000'000, " s without progress")
                                         : std::string("; no --stall-timeout: waiting on")));
      }
    }
    if (timeout > 0 && waited > timeout) return Stall(w, waited);
    if (waited < busy_ns) {
      continue;  // (tested again at once: the short waits of a step end at MPI's latency)
    } else if (waited < std::max(kSpinNs, busy_ns)) {
      Stats().yields.fetch_add(1, std::memory_order_relaxed);
      std::this_thread::yield();
    } else {
      Stats().sleeps.fetch_add(1, std::memory_order_relaxed);
      const int64_t before = MonotonicNs();
      std::this_thread::sleep_for(std::chrono::nanoseconds(std::min(kMaxSleepNs, waited / 8)));
      Stats().slept_ns.fetch_add(MonotonicNs() - before, std::memory_order_relaxed);
    }
  }
}

std::string MpiErrorString(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS || len <= 0) {
    return absl::StrCat("MPI error code ", code);
  }
  return std::string(text, len);
}

absl::Status MpiFailure(const std::string& op, const std::string& node,
                        const char* call, int code, const Comm& comm) {
  if (code == kAbandoned) {
    return absl::AbortedError(absl::StrCat(
        op, " (node '", node, "'): abandoned on rank ", comm.rank, " of ", comm.size,
        ": the job lost a rank"));
  }
  if (code == kStopped) {
    return absl::CancelledError(absl::StrCat(
        op, " (node '", node, "'): stopped on rank ", comm.rank, " of ", comm.size,
        ": a stop was requested (SIGINT or SIGTERM) while it waited for other ranks"));
  }
  if (code == kCancelled) {
    return absl::CancelledError(absl::StrCat(op, " (node '", node, "'): cancelled while it waited"));
  }
  if (code == kStalled) {
    std::lock_guard<std::mutex> lock(Watch().mu);
    return absl::DeadlineExceededError(Watch().stall_line);
  }
  return absl::InternalError(absl::StrCat(
      op, " (node '", node, "'): ", call, " failed on rank ", comm.rank,
      " of ", comm.size, ": ", MpiErrorString(code)));
}

// The error of an op that `does` something over `stages` pipeline stages (a phrase), in
// a process whose ranks are not split into that many stages.
absl::Status StagesMismatch(const std::string& op, const std::string& node, const std::string& does,
                            int stages) {
  const CommState& state = State();
  return absl::FailedPreconditionError(absl::StrCat(
      op, " (node '", node, "'): ", does, ", but this process's ranks are ",
      state.stages ? absl::StrCat("split into ", state.stages, " stages") : "not split into stages",
      "; train the model with 'vfgraph train', or call "
      "vfgraph.ops.set_communicator(comm, stages=", stages, ") first"));
}

// Sets `comm`'s rank and size from its communicator.
absl::Status FindRankAndSize(const std::string& op, const std::string& node, Comm* comm) {
  int rc = MPI_Comm_rank(comm->comm, &comm->rank);
  if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Comm_rank", rc, *comm);
  rc = MPI_Comm_size(comm->comm, &comm->size);
  if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Comm_size", rc, *comm);
  return absl::OkStatus();
}

// Checks that MPI can be used from this thread and returns the communicator in
// use, its rank and size. The caller holds CollectiveMutex(). `stages` > 0: the
// communicator of this rank's pipeline stage instead (the ranks equal to it modulo
// `stages`: the same stage of every replica), which vf_mpi_split_stages made.
absl::Status AcquireComm(const std::string& op, const std::string& node,
                         Comm* out, int stages = 0) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": MPI is not initialized in this process; import vfgraph (it "
        "initialises MPI through mpi4py) before running the graph"));
  }
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": MPI has already been finalized in this process; run the graph "
        "before the interpreter shuts down"));
  }
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, ": MPI was initialised with thread support level ", level,
        ", but TensorFlow runs kernels on its own threads and needs at least "
        "MPI_THREAD_SERIALIZED; keep mpi4py's default thread level "
        "(mpi4py.rc.thread_level = 'multiple')"));
  }
  CommState& state = State();
  Comm comm;
  comm.comm = state.user_comm ? state.comm : MPI_COMM_WORLD;
  if (stages > 0) {
    if (state.stages != stages) {
      return StagesMismatch(op, node, absl::StrCat("sums over the replicas of each of ", stages, " pipeline stages"),
                            stages);
    }
    comm.comm = state.stage_comm;
  }
  if (!state.errhandler_set) {
    const int rc = MPI_Comm_set_errhandler(comm.comm, MPI_ERRORS_RETURN);
    if (rc != MPI_SUCCESS) {
      return MpiFailure(op, node, "MPI_Comm_set_errhandler", rc, comm);
    }
    state.errhandler_set = true;
  }
  absl::Status status = FindRankAndSize(op, node, &comm);
  if (!status.ok()) return status;
  *out = comm;
  return absl::OkStatus();
}

// Creates the 16-bit datatypes and their sum operations on first use. The
// caller holds CollectiveMutex(). They live until MPI_Finalize frees them.
absl::Status EnsureHalfTypes(const std::string& op, const std::string& node,
                             const Comm& comm) {
  HalfTypes& t = Halves();
  if (t.made) return absl::OkStatus();
  MPI_Datatype* types[] = {&t.half, &t.bfloat16};
  for (MPI_Datatype* type : types) {
    int rc = MPI_Type_contiguous(2, MPI_BYTE, type);
    if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Type_contiguous", rc, comm);
    rc = MPI_Type_commit(type);
    if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Type_commit", rc, comm);
  }
  int rc = MPI_Op_create(&SumThroughFloat<Eigen::half>, /*commute=*/1, &t.half_sum);
  if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Op_create", rc, comm);
  rc = MPI_Op_create(&SumThroughFloat<Eigen::bfloat16>, /*commute=*/1, &t.bfloat16_sum);
  if (rc != MPI_SUCCESS) return MpiFailure(op, node, "MPI_Op_create", rc, comm);
  t.made = true;
  return absl::OkStatus();
}

// The MPI datatype and sum operation for an element type.
template <typename T>
struct MpiSum;
#define VF_MPI_SUM(T, TYPE, OP)                       \
  template <>                                         \
  struct MpiSum<T> {                                  \
    static MPI_Datatype Type() { return TYPE; }       \
    static MPI_Op Op() { return OP; }                 \
  };
VF_MPI_SUM(float, MPI_FLOAT, MPI_SUM)
VF_MPI_SUM(double, MPI_DOUBLE, MPI_SUM)
VF_MPI_SUM(int32_t, MPI_INT32_T, MPI_SUM)
VF_MPI_SUM(int64_t, MPI_INT64_T, MPI_SUM)
VF_MPI_SUM(Eigen::half, Halves().half, Halves().half_sum)
VF_MPI_SUM(Eigen::bfloat16, Halves().bfloat16, Halves().bfloat16_sum)
#undef VF_MPI_SUM

template <typename T>
constexpr bool kIsHalf =
    std::is_same<T, Eigen::half>::value || std::is_same<T, Eigen::bfloat16>::value;

// Asks for transparent huge pages behind a large buffer that has not been
// written yet (as numpy does for its arrays): its first writes take one page
// fault per 2 MiB instead of per 4 KiB, and the MPI library's cross-process
// copies walk fewer page-table entries. Advisory; failures are ignored.
void AdviseHugePages(void* data, size_t bytes) {
#ifdef MADV_HUGEPAGE
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  if (bytes < 2 * kHugePage) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#endif
}

// Backs the whole 2 MiB pages inside a large buffer that already holds data with
// transparent huge pages now (MADV_COLLAPSE, Linux >= 6.1), once per page
// address: TensorFlow's allocator hands the same memory to a step's gradient
// buffer again and again, so a reduced-in-place buffer is collapsed on its
// first use and the MPI library's copies of it walk 512 times fewer pages
// afterwards. Content is preserved. Advisory; failures (older kernels) are
// ignored. Called with the collective mutex held.
void CollapseHugePages(void* data, size_t bytes) {
#ifdef __linux__
  constexpr int kMadvCollapse = 25;  // MADV_COLLAPSE, not in every libc's headers
  constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
  static std::set<uintptr_t>* done = new std::set<uintptr_t>();
  static bool unsupported = false;
  if (unsupported || bytes < 2 * kHugePage) return;
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (start + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (start + bytes) & ~(kHugePage - 1);
  for (uintptr_t page = begin; page < end; page += kHugePage) {
    if (!done->insert(page).second) continue;
    if (madvise(reinterpret_cast<void*>(page), kHugePage, kMadvCollapse) != 0 && errno == EINVAL) {
      unsupported = true;  // no MADV_COLLAPSE here
      return;
    }
  }
#endif
}

// Waits for `request` (Await): kAbandoned when the job lost a rank, kStopped, kCancelled or
// kStalled when the wait gave up.
// `busy_ns`: how long it tests back to back before yielding (kTogetherBusyNs once every rank
// arrived: the wait is then MPI's own work).
int WaitPolling(MPI_Request* request, MPI_Status* status, int64_t busy_ns = kBusyNs) {
  return Await(request, status, busy_ns);
}

// Waits until every rank of `comm` has reached this call, polling (WaitPolling): a rank that
// waits for a slower one then leaves its CPU to the others instead of spinning in a blocking
// collective, which on shared cores (hyperthreads, ranks sharing a host) slows the very rank
// it waits for. The collective that follows runs with every rank present.
int ArriveTogether(MPI_Comm comm) {
  MPI_Request request;
  const int rc = MPI_Ibarrier(comm, &request);
  if (rc != MPI_SUCCESS) return rc;
  return WaitPolling(&request, MPI_STATUS_IGNORE);
}

// Starts a nonblocking MPI call (`start` takes the request to fill) and waits for it polling
// (WaitPolling): every wait of the ops can then give up when the job lost a rank, even one
// lost in the middle of moving data, where a blocking call would wait for ever.
template <typename Start>
int Polled(Start start, int64_t busy_ns = kBusyNs) {
  MPI_Request request;
  const int rc = start(&request);
  return rc != MPI_SUCCESS ? rc : WaitPolling(&request, MPI_STATUS_IGNORE, busy_ns);
}

// Copies the input into a freshly allocated output when the input buffer could
// not be forwarded (someone else still holds it).
void CopyUnlessForwarded(int forwarded, const Tensor& input, Tensor* output) {
  if (forwarded < 0 && input.TotalBytes() > 0) {
    AdviseHugePages(output->data(), input.TotalBytes());
    std::memcpy(output->data(), input.data(), input.TotalBytes());
  }
}

// Broadcasts `bytes` bytes at `data` from `root`, in pieces MPI's int counts allow.
int BroadcastBytes(char* data, int64_t bytes, int root, MPI_Comm comm) {
  for (int64_t done = 0; done < bytes; done += kMaxCount) {
    const int n = static_cast<int>(std::min(kMaxCount, bytes - done));
    const int rc = Polled([&](MPI_Request* r) { return MPI_Ibcast(data + done, n, MPI_BYTE, root, comm, r); });
    if (rc != MPI_SUCCESS) return rc;
  }
  return MPI_SUCCESS;
}

// The communicator of a broadcast from `root`. Every rank sees the same size and
// root, so all of them stop here alike when the root does not exist.
// AcquireComm's communicator, or with `stages` > 0 that of this rank's replica of a pipeline
// of `stages` stages (its group of `stages` consecutive ranks, in which stage k is rank k), which
// vf_mpi_split_stages made. The caller holds CollectiveMutex().
absl::Status AcquireReplicaComm(const std::string& op, const std::string& node, int stages, Comm* comm) {
  absl::Status status = AcquireComm(op, node, comm);
  if (!status.ok() || stages <= 0) return status;
  const CommState& state = State();
  if (state.stages != stages || state.replica_comm == MPI_COMM_NULL) {
    return StagesMismatch(op, node, absl::StrCat("runs among the ", stages, " pipeline stages of one replica"),
                          stages);
  }
  comm->comm = state.replica_comm;
  return FindRankAndSize(op, node, comm);
}

// The communicator of AcquireReplicaComm, checking that `root` is one of its ranks.
absl::Status AcquireRootComm(const std::string& op, const std::string& node, int root, Comm* comm,
                             int stages = 0) {
  absl::Status status = AcquireReplicaComm(op, node, stages, comm);
  if (!status.ok()) return status;
  if (root < 0 || root >= comm->size) {
    return absl::InvalidArgumentError(absl::StrCat(op, " (node '", node, "'): root rank ", root,
                                                   " does not exist in a communicator of size ",
                                                   comm->size));
  }
  return absl::OkStatus();
}

std::string ShapeString(const int64_t* dims, int64_t ndims) {
  std::vector<int64_t> v(dims, dims + ndims);
  return absl::StrCat("[", absl::StrJoin(v, ","), "]");
}

// What a broadcast sends ahead of the data: each tensor's dtype, rank and
// dimensions, one after another, so that a rank whose tensors differ from the
// root's gets an error instead of a truncated or hanging broadcast.
void AppendHeader(const Tensor& t, std::vector<int64_t>* header) {
  header->push_back(static_cast<int64_t>(t.dtype()));
  header->push_back(t.dims());
  for (int d = 0; d < t.dims(); ++d) header->push_back(t.dim_size(d));
}

// Replaces `header` by the root's (its length first, then its words).
int BroadcastHeader(std::vector<int64_t>* header, int root, MPI_Comm comm) {
  int64_t words = static_cast<int64_t>(header->size());
  int rc = Polled([&](MPI_Request* r) { return MPI_Ibcast(&words, 1, MPI_INT64_T, root, comm, r); });
  if (rc != MPI_SUCCESS) return rc;
  header->resize(static_cast<size_t>(words));
  return BroadcastBytes(reinterpret_cast<char*>(header->data()), words * 8, root, comm);
}

// One tensor's entry in a header: where it starts, and what it says.
struct HeaderEntry {
  const int64_t* at;
  DataType dtype() const { return static_cast<DataType>(at[0]); }
  int64_t ndims() const { return at[1]; }
  size_t words() const { return static_cast<size_t>(2 + at[1]); }
  int64_t bytes() const {
    int64_t elements = 1;
    for (int64_t d = 0; d < ndims(); ++d) elements *= at[2 + d];
    return elements * tensorflow::DataTypeSize(dtype());
  }
  bool Same(const HeaderEntry& other) const {
    return other.words() == words() && std::equal(at, at + words(), other.at);
  }
  std::string Describe() const {
    return absl::StrCat(DataTypeString(dtype()), " of shape ", ShapeString(at + 2, ndims()));
  }
};

// Takes part in a broadcast of `bytes` from the root into scratch memory: a rank
// whose tensor does not match the root's, which fails after the others are served.
absl::Status BroadcastIntoScratch(OpKernelContext* context, int64_t bytes, int root, MPI_Comm comm,
                                  int* rc) {
  Tensor scratch;
  absl::Status status = context->allocate_temp(tensorflow::DT_UINT8, TensorShape({bytes}), &scratch);
  if (!status.ok()) return status;
  *rc = BroadcastBytes(static_cast<char*>(scratch.data()), bytes, root, comm);
  return absl::OkStatus();
}

uint64_t Fnv1a(const void* data, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

// ---------------------------------------------------------------------------
// VfAllreduce

template <typename T>
class AllreduceOp : public OpKernel {
 public:
  explicit AllreduceOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
  }

  void Compute(OpKernelContext* context) override {
    const int64_t began = MonotonicNs();
    struct Total {
      int64_t began;
      ~Total() {
        Stats().calls.fetch_add(1);
        Stats().total_ns.fetch_add(MonotonicNs() - began);
      }
    } total{began};
    const Tensor& input = context->input(0);
    Tensor* output = nullptr;
    int forwarded = -1;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, input.shape(), &output, &forwarded));
    CopyUnlessForwarded(forwarded, input, output);
    Stats().bytes.fetch_add(static_cast<int64_t>(input.TotalBytes()));
    Stats().copy_ns.fetch_add(MonotonicNs() - began);

    std::lock_guard<std::mutex> lock(CollectiveMutex());
    BlockedClock blocked;
    if (forwarded >= 0) CollapseHugePages(output->data(), output->TotalBytes());
    Comm comm;
    OP_REQUIRES_OK(context, AcquireComm("VfAllreduce", name(), &comm, stages_));
    Watching watching(Collective("VfAllreduce", name(), comm, Counter(stages_), context));
    if (kIsHalf<T>) {
      OP_REQUIRES_OK(context, EnsureHalfTypes("VfAllreduce", name(), comm));
    }
    T* data = static_cast<T*>(output->data());
    const int64_t count = output->NumElements();
    const int64_t arriving = MonotonicNs();
    const int arrived = ArriveTogether(comm.comm);
    const int64_t reducing = MonotonicNs();
    Stats().arrive_ns.fetch_add(reducing - arriving);
    OP_REQUIRES(context, arrived == MPI_SUCCESS,
                MpiFailure("VfAllreduce", name(), "MPI_Ibarrier", arrived, comm));
    struct Reduced {
      int64_t began;
      ~Reduced() { Stats().reduce_ns.fetch_add(MonotonicNs() - began); }
    } reduced{reducing};
    // Zero elements still take part, so that every rank makes the same calls.
    int64_t done = 0;
    do {
      const int n = static_cast<int>(std::min(kMaxCount, count - done));
      const int rc = Polled([&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, data + done, n, MpiSum<T>::Type(), MpiSum<T>::Op(),
                              comm.comm, r);
      }, kTogetherBusyNs);
      OP_REQUIRES(context, rc == MPI_SUCCESS,
                  MpiFailure("VfAllreduce", name(), "MPI_Iallreduce", rc, comm));
      done += n;
    } while (done < count);
  }

 private:
  int stages_ = 0;
};

// ---------------------------------------------------------------------------
// VfBroadcast

class BroadcastOp : public OpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("root", &root_));
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    std::lock_guard<std::mutex> lock(CollectiveMutex());
    BlockedClock blocked;
    Comm comm;
    OP_REQUIRES_OK(context, AcquireRootComm("VfBroadcast", name(), root_, &comm, stages_));
    Watching watching(Collective("VfBroadcast", name(), comm,
                                 stages_ > 0 ? &State().replica_seq : Counter(0), context));

    std::vector<int64_t> mine, header;
    AppendHeader(input, &mine);
    header = mine;
    int rc = BroadcastHeader(&header, root_, comm.comm);
    OP_REQUIRES(context, rc == MPI_SUCCESS,
                MpiFailure("VfBroadcast", name(), "MPI_Ibcast", rc, comm));
    const HeaderEntry root_entry{header.data()};
    if (!root_entry.Same(HeaderEntry{mine.data()})) {
      OP_REQUIRES_OK(context, BroadcastIntoScratch(context, root_entry.bytes(), root_, comm.comm, &rc));
      OP_REQUIRES(context, rc == MPI_SUCCESS,
                  MpiFailure("VfBroadcast", name(), "MPI_Ibcast", rc, comm));
      context->CtxFailure(absl::InvalidArgumentError(absl::StrCat(
          "VfBroadcast (node '", name(), "'): rank ", comm.rank, " has a ",
          DataTypeString(input.dtype()), " input of shape ",
          input.shape().DebugString(), " but root rank ", root_, " has a ",
          DataTypeString(root_entry.dtype()), " input of shape ",
          ShapeString(root_entry.at + 2, root_entry.ndims()),
          "; every rank must pass the same dtype and shape")));
      return;
    }

    Tensor* output = nullptr;
    int forwarded = -1;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output(
                                {0}, 0, input.shape(), &output, &forwarded));
    if (comm.rank == root_) {
      CopyUnlessForwarded(forwarded, input, output);
    } else if (forwarded < 0) {
      AdviseHugePages(output->data(), output->TotalBytes());
    }
    rc = BroadcastBytes(static_cast<char*>(output->data()),
                        static_cast<int64_t>(output->TotalBytes()), root_, comm.comm);
    OP_REQUIRES(context, rc == MPI_SUCCESS,
                MpiFailure("VfBroadcast", name(), "MPI_Ibcast", rc, comm));
  }

 private:
  int root_ = 0;
  int stages_ = 0;  // > 0: among the stages of this rank's replica (AcquireReplicaComm)
};

// ---------------------------------------------------------------------------
// VfBroadcastVariables

bool BroadcastableType(DataType t) {  // the types VfBroadcast takes
  switch (t) {
    case tensorflow::DT_HALF:
    case tensorflow::DT_BFLOAT16:
    case tensorflow::DT_FLOAT:
    case tensorflow::DT_DOUBLE:
    case tensorflow::DT_INT32:
    case tensorflow::DT_INT64:
    case tensorflow::DT_UINT8:
    case tensorflow::DT_INT8:
    case tensorflow::DT_BOOL:
      return true;
    default:
      return false;
  }
}

// Rank `root`'s value of every variable, written into the variables of every
// other rank in place: one op for a whole model instead of a read, a broadcast
// and an assignment per variable. A variable buffer that a read still holds is
// replaced by a fresh one first, as TensorFlow's own in-place updates do.
class BroadcastVariablesOp : public OpKernel {
 public:
  explicit BroadcastVariablesOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("root", &root_));
  }

  void Compute(OpKernelContext* context) override {
    const int n = context->num_inputs();
    std::vector<tensorflow::core::RefCountPtr<tensorflow::Var>> vars(n);
    std::vector<tensorflow::mutex*> mutexes;
    for (int i = 0; i < n; ++i) {
      OP_REQUIRES_OK(context, tensorflow::LookupResource(
                                  context, tensorflow::HandleFromInput(context, i), &vars[i]));
      mutexes.push_back(vars[i]->mu());
    }
    // Each variable locked once, in address order, for the whole exchange.
    std::sort(mutexes.begin(), mutexes.end());
    mutexes.erase(std::unique(mutexes.begin(), mutexes.end()), mutexes.end());
    for (tensorflow::mutex* mu : mutexes) mu->lock();
    struct Unlock {
      std::vector<tensorflow::mutex*>& mus;
      ~Unlock() {
        for (tensorflow::mutex* mu : mus) mu->unlock();
      }
    } unlock{mutexes};
    for (int i = 0; i < n; ++i) {
      const Tensor& t = *vars[i]->tensor();
      OP_REQUIRES(context, vars[i]->is_initialized && BroadcastableType(t.dtype()),
                  absl::InvalidArgumentError(absl::StrCat(
                      "VfBroadcastVariables (node '", name(), "'): variable ", Describe(context, i),
                      vars[i]->is_initialized ? absl::StrCat(" has type ", DataTypeString(t.dtype()),
                                                             ", which cannot be broadcast")
                                              : " is not initialized")));
    }

    std::lock_guard<std::mutex> lock(CollectiveMutex());
    BlockedClock blocked;
    Comm comm;
    OP_REQUIRES_OK(context, AcquireRootComm("VfBroadcastVariables", name(), root_, &comm));
    Watching watching(Collective("VfBroadcastVariables", name(), comm, Counter(0), context));

    std::vector<int64_t> mine, header;
    for (int i = 0; i < n; ++i) AppendHeader(*vars[i]->tensor(), &mine);
    header = mine;
    int rc = BroadcastHeader(&header, root_, comm.comm);
    OP_REQUIRES(context, rc == MPI_SUCCESS,
                MpiFailure("VfBroadcastVariables", name(), "MPI_Ibcast", rc, comm));

    std::vector<HeaderEntry> root_entries;
    for (size_t at = 0; at < header.size(); at += root_entries.back().words()) {
      root_entries.push_back(HeaderEntry{header.data() + at});
    }
    const int count = static_cast<int>(root_entries.size());
    std::string mismatch;  // what this rank has that the root does not, first only
    if (count != n) {  // every rank runs the root's broadcasts; this one into scratch memory
      mismatch = absl::StrCat("rank ", comm.rank, " has ", n, " variables but root rank ", root_, " has ", count);
    }
    size_t at = 0;
    for (int i = 0; i < count; ++i) {
      const HeaderEntry& root_entry = root_entries[i];
      if (count != n) {
        OP_REQUIRES_OK(context, BroadcastIntoScratch(context, root_entry.bytes(), root_, comm.comm, &rc));
        OP_REQUIRES(context, rc == MPI_SUCCESS,
                    MpiFailure("VfBroadcastVariables", name(), "MPI_Ibcast", rc, comm));
        continue;
      }
      const HeaderEntry own{mine.data() + at};
      at += own.words();
      Tensor* t = vars[i]->tensor();
      if (!root_entry.Same(own)) {
        if (mismatch.empty()) {
          mismatch = absl::StrCat("rank ", comm.rank, " has variable ", Describe(context, i), " as ",
                                  own.Describe(), " but root rank ", root_, " has it as ", root_entry.Describe());
        }
        OP_REQUIRES_OK(context, BroadcastIntoScratch(context, root_entry.bytes(), root_, comm.comm, &rc));
      } else {
        if (comm.rank != root_ && (vars[i]->copy_on_read_mode.load() || !t->RefCountIsOne())) {
          Tensor fresh;  // every byte is overwritten below: nothing to copy
          OP_REQUIRES_OK(context, context->allocate_temp(t->dtype(), t->shape(), &fresh));
          *t = fresh;
        }
        rc = BroadcastBytes(static_cast<char*>(t->data()), static_cast<int64_t>(t->TotalBytes()), root_,
                            comm.comm);
      }
      OP_REQUIRES(context, rc == MPI_SUCCESS,
                  MpiFailure("VfBroadcastVariables", name(), "MPI_Ibcast", rc, comm));
    }
    if (!mismatch.empty()) {
      context->CtxFailure(absl::InvalidArgumentError(absl::StrCat(
          "VfBroadcastVariables (node '", name(), "'): ", mismatch, "; every rank must load the same model")));
    }
  }

 private:
  static std::string Describe(OpKernelContext* context, int i) {
    return absl::StrCat(i, " ('", tensorflow::HandleFromInput(context, i).name(), "')");
  }

  int root_ = 0;
};

// ---------------------------------------------------------------------------
// VfAllgather

// What each rank tells the others about its input before the data moves.
struct GatherRecord {
  int64_t ndims;
  int64_t dtype;
  int64_t dim0;
  int64_t bytes;
  uint64_t trailing_hash;  // of dims 1..ndims-1
};
constexpr int kRecordWords = sizeof(GatherRecord) / sizeof(int64_t);

class AllgatherOp : public OpKernel {
 public:
  explicit AllgatherOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
  }

  void Compute(OpKernelContext* context) override {
    const Tensor& input = context->input(0);
    std::lock_guard<std::mutex> lock(CollectiveMutex());
    BlockedClock blocked;
    Comm comm;
    OP_REQUIRES_OK(context, AcquireComm("VfAllgather", name(), &comm, stages_));
    Watching watching(Collective("VfAllgather", name(), comm, Counter(stages_), context));

    const int ndims = input.dims();
    // One copy of the sizes: dim_sizes() returns a new vector on every call.
    const auto sizes = input.shape().dim_sizes();
    std::vector<int64_t> dims(sizes.begin(), sizes.end());
    GatherRecord mine;
    mine.ndims = ndims;
    mine.dtype = static_cast<int64_t>(input.dtype());
    mine.dim0 = ndims > 0 ? dims[0] : 0;
    mine.bytes = static_cast<int64_t>(input.TotalBytes());
    mine.trailing_hash =
        ndims > 1 ? Fnv1a(dims.data() + 1, sizeof(int64_t) * (ndims - 1)) : 0;
    std::vector<GatherRecord> all(comm.size);
    int rc = ArriveTogether(comm.comm);
    OP_REQUIRES(context, rc == MPI_SUCCESS, MpiFailure("VfAllgather", name(), "MPI_Ibarrier", rc, comm));
    rc = Polled([&](MPI_Request* r) {
      return MPI_Iallgather(&mine, kRecordWords, MPI_INT64_T, all.data(), kRecordWords,
                            MPI_INT64_T, comm.comm, r);
    }, kTogetherBusyNs);
    OP_REQUIRES(context, rc == MPI_SUCCESS,
                MpiFailure("VfAllgather", name(), "MPI_Iallgather", rc, comm));

    // Every rank now holds the same records, so every rank reaches the same
    // verdict below and they all fail (or proceed) together.
    bool agree = true;
    for (const GatherRecord& r : all) {
      agree = agree && r.ndims == all[0].ndims && r.dtype == all[0].dtype &&
              r.trailing_hash == all[0].trailing_hash;
    }
    if (!agree || all[0].ndims == 0) {
      context->CtxFailure(ShapeMismatch(comm, dims, all));
      return;
    }

    std::vector<int64_t> counts(comm.size), displs(comm.size);
    int64_t rows = 0, total = 0;
    bool fits_int = true;
    for (int r = 0; r < comm.size; ++r) {
      counts[r] = all[r].bytes;
      displs[r] = total;
      total += all[r].bytes;
      rows += all[r].dim0;
      fits_int = fits_int && counts[r] <= INT_MAX && displs[r] <= INT_MAX;
    }
    fits_int = fits_int && total <= INT_MAX;
    TensorShape out_shape = input.shape();
    OP_REQUIRES_OK(context, out_shape.SetDimWithStatus(0, rows));
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, out_shape, &output));
    char* out = static_cast<char*>(output->data());
    AdviseHugePages(out, static_cast<size_t>(total));

    if (fits_int) {
      std::vector<int> icounts(counts.begin(), counts.end());
      std::vector<int> idispls(displs.begin(), displs.end());
      rc = Polled([&](MPI_Request* r) {
        return MPI_Iallgatherv(input.data(), static_cast<int>(mine.bytes), MPI_BYTE, out,
                               icounts.data(), idispls.data(), MPI_BYTE, comm.comm, r);
      }, kTogetherBusyNs);
      OP_REQUIRES(context, rc == MPI_SUCCESS,
                  MpiFailure("VfAllgather", name(), "MPI_Iallgatherv", rc, comm));
      return;
    }
    // Beyond int counts: each rank broadcasts its block in turn.
    if (mine.bytes > 0) std::memcpy(out + displs[comm.rank], input.data(), mine.bytes);
    for (int r = 0; r < comm.size; ++r) {
      rc = BroadcastBytes(out + displs[r], counts[r], r, comm.comm);
      OP_REQUIRES(context, rc == MPI_SUCCESS,
                  MpiFailure("VfAllgather", name(), "MPI_Ibcast", rc, comm));
    }
  }

 private:
  int stages_ = 0;

  // The error for inputs that cannot be concatenated. Collects every rank's
  // shape (a collective all ranks enter, having seen the same records).
  absl::Status ShapeMismatch(const Comm& comm, const std::vector<int64_t>& dims,
                             const std::vector<GatherRecord>& all) {
    std::vector<int> counts(comm.size), displs(comm.size);
    int total = 0;
    for (int r = 0; r < comm.size; ++r) {
      counts[r] = static_cast<int>(all[r].ndims);
      displs[r] = total;
      total += counts[r];
    }
    std::vector<int64_t> every(std::max(total, 1));
    const int rc = Polled([&](MPI_Request* r) {
      return MPI_Iallgatherv(dims.data(), static_cast<int>(dims.size()), MPI_INT64_T,
                             every.data(), counts.data(), displs.data(), MPI_INT64_T, comm.comm, r);
    });
    if (rc != MPI_SUCCESS) return MpiFailure("VfAllgather", name(), "MPI_Iallgatherv", rc, comm);
    auto describe = [&](int r) {
      return absl::StrCat("rank ", r, " has ",
                          DataTypeString(static_cast<DataType>(all[r].dtype)), " ",
                          ShapeString(every.data() + displs[r], all[r].ndims));
    };
    const std::string prefix = absl::StrCat("VfAllgather (node '", name(), "'): ");
    for (int r = 0; r < comm.size; ++r) {
      if (all[r].ndims == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            prefix, "inputs are concatenated along dimension 0 and need at least one "
            "dimension, but ", describe(r)));
      }
    }
    for (int r = 1; r < comm.size; ++r) {
      bool same = all[r].ndims == all[0].ndims && all[r].dtype == all[0].dtype;
      for (int i = 1; same && i < all[0].ndims; ++i) {
        same = every[displs[r] + i] == every[displs[0] + i];
      }
      if (!same) {
        return absl::InvalidArgumentError(absl::StrCat(
            prefix, "every rank's input must have the same dtype and the same shape "
            "except for dimension 0, but ", describe(0), " and ", describe(r)));
      }
    }
    return absl::InternalError(absl::StrCat(
        prefix, "input shapes disagree across ranks (shape digests differ)"));
  }
};

// ---------------------------------------------------------------------------
// VfCheck

class CheckOp : public OpKernel {
 public:
  explicit CheckOp(OpKernelConstruction* context) : OpKernel(context) {
    std::string fingerprint;
    OP_REQUIRES_OK(context, context->GetAttr("fingerprint", &fingerprint));
    OP_REQUIRES_OK(context, context->GetAttr("what", &what_));
    // Short fingerprints (a hex SHA-256 is 64 characters) are compared as they
    // are; longer ones by a digest of the whole string.
    std::string record = fingerprint;
    if (record.size() > static_cast<size_t>(kFingerprintBytes)) {
      const uint64_t a = Fnv1a(fingerprint.data(), fingerprint.size());
      const uint64_t b = Fnv1a(fingerprint.data(), fingerprint.size(), a ^ 0x9e3779b97f4a7c15ull);
      record = absl::StrCat("fnv:", absl::Hex(a, absl::kZeroPad16),
                            absl::Hex(b, absl::kZeroPad16), ":", fingerprint.size());
    }
    record_.assign(kFingerprintBytes, '\0');
    std::memcpy(&record_[0], record.data(), std::min(record.size(), record_.size()));
  }

  void Compute(OpKernelContext* context) override {
    std::lock_guard<std::mutex> lock(CollectiveMutex());
    BlockedClock blocked;
    Comm comm;
    OP_REQUIRES_OK(context, AcquireComm("VfCheck", name(), &comm));
    Watching watching(Collective("VfCheck", name(), comm, Counter(0), context));
    std::vector<char> all(static_cast<size_t>(kFingerprintBytes) * comm.size);
    const int rc = Polled([&](MPI_Request* r) {
      return MPI_Iallgather(record_.data(), kFingerprintBytes, MPI_BYTE, all.data(),
                            kFingerprintBytes, MPI_BYTE, comm.comm, r);
    });
    OP_REQUIRES(context, rc == MPI_SUCCESS,
                MpiFailure("VfCheck", name(), "MPI_Iallgather", rc, comm));
    auto at = [&](int r) { return all.data() + static_cast<size_t>(r) * kFingerprintBytes; };
    int first_other = -1, others = 0;
    for (int r = 1; r < comm.size; ++r) {
      if (std::memcmp(at(0), at(r), kFingerprintBytes) != 0) {
        if (first_other < 0) first_other = r;
        ++others;
      }
    }
    if (first_other < 0) return;
    std::string extra;
    if (others > 1) {
      extra = absl::StrCat(" (", others, " of ", comm.size - 1,
                           " other ranks differ from rank 0)");
    }
    context->CtxFailure(absl::FailedPreconditionError(absl::StrCat(
        "VfCheck: ranks run different graphs (", what_, "): rank 0 has fingerprint ",
        Short(at(0)), ", rank ", first_other, " has ", Short(at(first_other)), extra,
        "; rewrite once and give every rank the same model")));
  }

 private:
  static std::string Short(const char* record) {
    const size_t n = strnlen(record, kFingerprintBytes);
    std::string s(record, n);
    return s.size() > 12 ? s.substr(0, 12) + ".." : s;
  }

  std::string what_;
  std::string record_;
};

// ---------------------------------------------------------------------------
// VfRank, VfSize

template <bool kRank>
class CommInfoOp : public OpKernel {
 public:
  explicit CommInfoOp(OpKernelConstruction* context) : OpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
  }

  void Compute(OpKernelContext* context) override {
    Comm comm;
    {
      std::lock_guard<std::mutex> lock(CollectiveMutex());
      OP_REQUIRES_OK(context, AcquireComm(kRank ? "VfRank" : "VfSize", name(), &comm, stages_));
    }
    Tensor* output = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({}), &output));
    output->scalar<int32_t>()() = kRank ? comm.rank : comm.size;
  }

 private:
  int stages_ = 0;
};

// ---------------------------------------------------------------------------
// VfSend, VfRecv: a tensor from one rank to another. A message is a header (the
// dtype, the rank and the dimensions, int64, tag 2*tag) and the data (bytes, tag
// 2*tag+1, in pieces of at most kMaxCount bytes); messages of the same tag between
// two ranks arrive in the order they were sent (MPI's non-overtaking rule).

// The peer's rank: `stage` of the group of `stages` consecutive ranks this rank
// belongs to (one replica of a pipeline).
absl::Status PeerComm(const std::string& op, const std::string& node, int stage, int stages,
                      int tag, Comm* comm, int* peer) {
  {
    std::lock_guard<std::mutex> lock(CollectiveMutex());
    absl::Status status = AcquireComm(op, node, comm);
    if (!status.ok()) return status;
  }
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, " (node '", node, "'): MPI was initialised with thread support level ", level,
        ", but pipeline stages send and receive from several threads at once and need "
        "MPI_THREAD_MULTIPLE; keep mpi4py's default thread level (mpi4py.rc.thread_level = "
        "'multiple')"));
  }
  if (stages < 1 || comm->size % stages != 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        op, " (node '", node, "'): the model runs ", stages, " pipeline stages, which ",
        comm->size, " ranks cannot hold; start a multiple of ", stages, " ranks"));
  }
  if (stage < 0 || stage >= stages) {
    return absl::InvalidArgumentError(absl::StrCat(op, " (node '", node, "'): stage ", stage,
                                                   " is not one of the ", stages, " stages"));
  }
  void* attr = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm->comm, MPI_TAG_UB, &attr, &found);
  const int64_t ub = found ? *static_cast<int*>(attr) : 32767;
  if (tag < 0 || 2 * int64_t{tag} + 1 >= ub) {  // (tag ub: the watchdog's announcements)
    return absl::InvalidArgumentError(absl::StrCat(
        op, " (node '", node, "'): message tag ", tag, " is out of the MPI library's range (",
        "largest ", ub, "); run fewer virtual nodes per step"));
  }
  *peer = comm->rank - comm->rank % stages + stage;
  return absl::OkStatus();
}

// The waits of VfSend and VfRecv. A message's thread lowers itself to SCHED_IDLE
// (IdleThread) and then polls (Await): for its first millisecond it spins on MPI_Test and
// sched_yield, which the scheduler allows only when no other thread wants the CPU, so it
// costs the stage's computing nothing and sees an arrival at once when the stage waits for
// it; then it sleeps between tests, at most 1 ms and an eighth of the time waited, so a
// stage that waits long (a stalled or much slower peer) does not burn its core. Such a thread may not run for
// as long as the stage computes, and some transports (TCP between hosts, say) move a
// large message only while the sender makes progress: while any message is in flight, a
// keeper thread of normal priority calls MPI_Iprobe (which makes progress) every
// millisecond, under the keeper's mutex, which the last wait's end takes, so the keeper
// never calls MPI once no message is in flight (MPI may then be finalised).
class MessageWait {
 public:
  MessageWait() {
    std::lock_guard<std::mutex> lock(Mutex());
    if (Count()++ == 0) Wake().notify_one();
    static std::once_flag started;
    std::call_once(started, [] { std::thread(Keep).detach(); });
  }
  ~MessageWait() {
    std::lock_guard<std::mutex> lock(Mutex());
    --Count();
  }

 private:
  static std::mutex& Mutex() {
    static std::mutex* m = new std::mutex;
    return *m;
  }
  static std::condition_variable& Wake() {
    static std::condition_variable* c = new std::condition_variable;
    return *c;
  }
  static int& Count() {
    static int count = 0;
    return count;
  }
  static void Keep() {
    std::unique_lock<std::mutex> lock(Mutex());
    for (;;) {
      Wake().wait(lock, [] { return Count() > 0; });
      lock.unlock();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      lock.lock();
      if (Count() > 0) {
        int flag = 0;
        MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
      }
    }
  }
};

// Lowers the calling thread to SCHED_IDLE; false where the system has no such policy.
bool IdleThread() {
#ifdef SCHED_IDLE
  struct sched_param param = {};
  return sched_setscheduler(0, SCHED_IDLE, &param) == 0;
#else
  return false;
#endif
}

// Waits for a message's `request` (Await); at SCHED_IDLE (`idle`), with a keeper thread making
// MPI's progress while this one may not run.
int WaitMessage(MPI_Request* request, MPI_Status* status, bool idle) {
  if (!idle) return Await(request, status);
  MessageWait in_flight;
  return Await(request, status);
}

// Receives message `tag` from `peer` into `count` elements of `type` at `data`.
int RecvMessage(void* data, int count, MPI_Datatype type, int peer, int tag, MPI_Comm comm,
                MPI_Status* status, bool idle) {
  MPI_Request request;
  const int rc = MPI_Irecv(data, count, type, peer, tag, comm, &request);
  return rc != MPI_SUCCESS ? rc : WaitMessage(&request, status, idle);
}

class SendOp : public AsyncOpKernel {
 public:
  explicit SendOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("stage", &stage_));
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
  }

  // The message leaves at once: its header and data are posted here, on the thread that
  // runs the op, so the peer can take them while this rank computes on (a message's own
  // thread, at SCHED_IDLE, would post them only when the rank next waits, which in a
  // balanced pipeline is a wait of the peer's too). A thread of its own waits for the
  // delivery.
  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const Tensor input = context->input(0);
    const int tag = context->input(1).scalar<int32_t>()();
    Comm comm;
    int peer = -1;
    OP_REQUIRES_OK_ASYNC(context, PeerComm("VfSend", name(), stage_, stages_, tag, &comm, &peer),
                         done);
    auto header = std::make_shared<std::vector<int64_t>>(
        std::initializer_list<int64_t>{static_cast<int64_t>(input.dtype()), input.dims()});
    for (int d = 0; d < input.dims(); ++d) header->push_back(input.dim_size(d));
    auto requests = std::make_shared<std::vector<MPI_Request>>();
    MPI_Request request;
    int rc = MPI_Isend(header->data(), static_cast<int>(header->size()), MPI_INT64_T, peer, 2 * tag,
                       comm.comm, &request);
    if (rc == MPI_SUCCESS) requests->push_back(request);
    const char* data = static_cast<const char*>(input.tensor_data().data());
    const int64_t bytes = static_cast<int64_t>(input.TotalBytes());
    for (int64_t at = 0; rc == MPI_SUCCESS && at < bytes; at += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, bytes - at));
      rc = MPI_Isend(data + at, n, MPI_BYTE, peer, 2 * tag + 1, comm.comm, &request);
      if (rc == MPI_SUCCESS) requests->push_back(request);
    }
    if (rc != MPI_SUCCESS) {
      for (MPI_Request& posted : *requests) MPI_Request_free(&posted);
      context->SetStatus(MpiFailure("VfSend", name(), "MPI_Isend", rc, comm));
      done();
      return;
    }
    std::thread([this, context, done, input, header, requests, comm, peer, tag]() {
      Watching watching(Message("VfSend", name(), peer, tag, true, context));
      const bool idle = IdleThread();
      int rc = MPI_SUCCESS;
      for (MPI_Request& posted : *requests) {
        if (rc == MPI_SUCCESS) {
          rc = WaitMessage(&posted, MPI_STATUS_IGNORE, idle);
        } else {
          MPI_Request_free(&posted);
        }
      }
      if (rc != MPI_SUCCESS) {
        context->SetStatus(MpiFailure("VfSend", name(), "MPI_Isend", rc, comm));
      }
      done();
    }).detach();
  }

 private:
  int stage_ = 0;
  int stages_ = 1;
};

class RecvOp : public AsyncOpKernel {
 public:
  explicit RecvOp(OpKernelConstruction* context) : AsyncOpKernel(context) {
    OP_REQUIRES_OK(context, context->GetAttr("stage", &stage_));
    OP_REQUIRES_OK(context, context->GetAttr("stages", &stages_));
    OP_REQUIRES_OK(context, context->GetAttr("T", &dtype_));
  }

  void ComputeAsync(OpKernelContext* context, DoneCallback done) override {
    const int tag = context->input(0).scalar<int32_t>()();
    Comm comm;
    int peer = -1;
    OP_REQUIRES_OK_ASYNC(context, PeerComm("VfRecv", name(), stage_, stages_, tag, &comm, &peer),
                         done);
    std::thread([this, context, done, tag, comm, peer]() {
      Watching watching(Message("VfRecv", name(), peer, tag, false, context));
      context->SetStatus(Receive(context, tag, comm, peer, IdleThread()));
      done();
    }).detach();
  }

 private:
  absl::Status Receive(OpKernelContext* context, int tag, const Comm& comm, int peer, bool idle) {
    // The header: the dtype, the rank and at most kMaxDims dimensions.
    constexpr int kMaxDims = 254;
    MPI_Status status;
    std::vector<int64_t> header(2 + kMaxDims);
    int rc = RecvMessage(header.data(), static_cast<int>(header.size()), MPI_INT64_T, peer, 2 * tag,
                         comm.comm, &status, idle);
    if (rc != MPI_SUCCESS) return MpiFailure("VfRecv", name(), "MPI_Irecv", rc, comm);
    int words = 0;
    MPI_Get_count(&status, MPI_INT64_T, &words);
    if (words < 2) {
      return absl::InvalidArgumentError(absl::StrCat("VfRecv (node '", name(), "'): message ", tag,
                                                     " from rank ", peer, " has no tensor header"));
    }
    TensorShape shape;
    for (int64_t d = 0; d < header[1] && 2 + d < words; ++d) {
      absl::Status s = shape.AddDimWithStatus(header[2 + d]);
      if (!s.ok()) return s;
    }
    if (static_cast<DataType>(header[0]) != dtype_ || words != 2 + header[1]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "VfRecv (node '", name(), "'): rank ", peer, " sent ", DataTypeString(static_cast<DataType>(header[0])),
          " where this graph expects ", DataTypeString(dtype_),
          " (message ", tag, "); every rank must run the same rewritten model"));
    }
    Tensor* output = nullptr;
    absl::Status s = context->allocate_output(0, shape, &output);
    if (!s.ok()) return s;
    char* data = const_cast<char*>(output->tensor_data().data());
    const int64_t bytes = static_cast<int64_t>(output->TotalBytes());
    for (int64_t at = 0; at < bytes; at += kMaxCount) {
      const int n = static_cast<int>(std::min(kMaxCount, bytes - at));
      rc = RecvMessage(data + at, n, MPI_BYTE, peer, 2 * tag + 1, comm.comm, MPI_STATUS_IGNORE, idle);
      if (rc != MPI_SUCCESS) return MpiFailure("VfRecv", name(), "MPI_Irecv", rc, comm);
    }
    return absl::OkStatus();
  }

  int stage_ = 0;
  int stages_ = 1;
  DataType dtype_;
};

// ---------------------------------------------------------------------------
// VfExactAdd: sum + the words of values. A value x is held, truncated toward zero to a
// multiple of 2^-60, as N = x * 2^60 split into two int64 words, hi = N / 2^40 and
// lo = N % 2^40 (both with the sign of x), at the position of x among the values (hi
// words first, then lo words); integer sums of words do not depend on the order of the
// additions, and the sum is hi * 2^-20 + lo * 2^-60 (vfgraph.ir.blocks.from_exact). A
// float's words come from its bits alone (exponent and mantissa: integer shifts); a
// double's from exact double arithmetic. A value that is not finite or whose magnitude
// reaches 2^31 adds nothing and adds 1 to the last word (the sum is then NaN).

constexpr uint64_t kExactLowMask = (uint64_t{1} << 40) - 1;

// Adds float x's words to *hi and *lo; false when x is outside the limit.
inline bool AddFloatWords(float x, int64_t* hi, int64_t* lo) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const int e = static_cast<int>((bits >> 23) & 0xff);
  if (e >= 158) return false;  // |x| >= 2^31, infinities, NaN
  if (e == 0) return true;     // zero or subnormal: below 2^-60
  const uint64_t m = (bits & 0x7fffff) | 0x800000;  // x = m * 2^(e - 150), N = m * 2^(e - 90)
  const int sh = e - 90;
  uint64_t h = 0, l = 0;
  if (sh >= 40) {
    h = m << (sh - 40);
  } else if (sh >= 0) {
    const uint64_t n = m << sh;  // < 2^63
    h = n >> 40;
    l = n & kExactLowMask;
  } else if (sh > -24) {
    l = m >> (-sh);
  } else {
    return true;
  }
  if (bits >> 31) {
    *hi -= static_cast<int64_t>(h);
    *lo -= static_cast<int64_t>(l);
  } else {
    *hi += static_cast<int64_t>(h);
    *lo += static_cast<int64_t>(l);
  }
  return true;
}

// The same for a double: N = trunc(x * 2^60) in two parts, by exact double arithmetic.
inline bool AddDoubleWords(double x, int64_t* hi, int64_t* lo) {
  if (!(std::fabs(x) < 2147483648.0)) return false;  // NaN too
  const double s = x * 1048576.0;            // 2^20: exact
  const double h = std::trunc(s);
  *hi += static_cast<int64_t>(h);
  *lo += static_cast<int64_t>((s - h) * 1099511627776.0);  // 2^40: exact, then truncated
  return true;
}

inline bool AddWords(float x, int64_t* hi, int64_t* lo) { return AddFloatWords(x, hi, lo); }
inline bool AddWords(Eigen::half x, int64_t* hi, int64_t* lo) {
  return AddFloatWords(static_cast<float>(x), hi, lo);
}
inline bool AddWords(Eigen::bfloat16 x, int64_t* hi, int64_t* lo) {
  return AddFloatWords(static_cast<float>(x), hi, lo);
}
inline bool AddWords(double x, int64_t* hi, int64_t* lo) { return AddDoubleWords(x, hi, lo); }

template <typename T>
class ExactAddOp : public OpKernel {
 public:
  explicit ExactAddOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& sum = context->input(0);
    const int count = context->num_inputs() - 1;
    int64_t n = 0;
    for (int k = 0; k < count; ++k) n += context->input(1 + k).NumElements();
    OP_REQUIRES(context, sum.dims() == 1 && sum.NumElements() == 2 * n + 1,
                absl::InvalidArgumentError(absl::StrCat(
                    "VfExactAdd (node '", name(), "'): the sum holds ", sum.NumElements(),
                    " words, the values need 2 * ", n, " + 1")));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->forward_input_or_allocate_output({0}, 0, sum.shape(), &out));
    int64_t* words = out->flat<int64_t>().data();
    if (out->tensor_data().data() != sum.tensor_data().data()) {
      std::memcpy(words, sum.flat<int64_t>().data(), sizeof(int64_t) * (2 * n + 1));
    }
    std::atomic<bool> bad{false};
    auto* pool = context->device()->tensorflow_cpu_worker_threads();
    int64_t at = 0;
    for (int k = 0; k < count; ++k) {
      const T* values = context->input(1 + k).flat<T>().data();
      const int64_t size = context->input(1 + k).NumElements();
      int64_t* hi = words + at;
      int64_t* lo = words + n + at;
      auto work = [values, hi, lo, &bad](int64_t begin, int64_t end) {
        bool fine = true;
        for (int64_t i = begin; i < end; ++i) fine &= AddWords(values[i], hi + i, lo + i);
        if (!fine) bad.store(true, std::memory_order_relaxed);
      };
      if (size < 65536) {
        work(0, size);
      } else {
        ::tensorflow::Shard(pool->num_threads, pool->workers, size, /*cost_per_unit=*/8, work);
      }
      at += size;
    }
    if (bad.load()) words[2 * n] += 1;
  }
};

// VfExactValue: the values of summed words (hi * 2^-20 + lo * 2^-60, each rounded once
// to T), all NaN when the last word says a term was outside the limit.
template <typename T>
class ExactValueOp : public OpKernel {
 public:
  explicit ExactValueOp(OpKernelConstruction* context) : OpKernel(context) {}

  void Compute(OpKernelContext* context) override {
    const Tensor& sum = context->input(0);
    OP_REQUIRES(context, sum.dims() == 1 && sum.NumElements() % 2 == 1,
                absl::InvalidArgumentError(absl::StrCat("VfExactValue (node '", name(), "'): ",
                                                        sum.NumElements(), " words are not 2 * n + 1")));
    const int64_t n = sum.NumElements() / 2;
    Tensor* out = nullptr;
    OP_REQUIRES_OK(context, context->allocate_output(0, TensorShape({n}), &out));
    const int64_t* words = sum.flat<int64_t>().data();
    T* values = out->flat<T>().data();
    const bool bad = words[2 * n] > 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lo = words[n + i];
      const int64_t carry = lo >= 0 ? lo >> 40 : -((-lo + static_cast<int64_t>(kExactLowMask)) >> 40);
      const int64_t hi = words[i] + carry;  // lo - carry * 2^40 is in [0, 2^40)
      const double v = static_cast<double>(hi) * (1.0 / 1048576.0) +
                       static_cast<double>(lo - carry * (int64_t{1} << 40)) * (1.0 / 1152921504606846976.0);
      values[i] = static_cast<T>(bad ? std::nan("") : v);
    }
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// Registrations

REGISTER_OP("VfAllreduce")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64}")
    .Attr("stages: int = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
Elementwise sum of `input` over every rank of the communicator; every rank
passes the same shape and receives the sum. `stages` > 0: over the ranks of this
rank's pipeline stage only (those equal to it modulo `stages`).
)doc");

REGISTER_OP("VfBroadcast")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64, uint8, int8, bool}")
    .Attr("root: int = 0")
    .Attr("stages: int = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
The `input` of rank `root`, on every rank; every rank passes the same shape.
`stages` > 0: among the ranks of this rank's replica of a pipeline of `stages`
stages only (its group of `stages` consecutive ranks), from the one running
stage `root`.
)doc");

REGISTER_OP("VfBroadcastVariables")
    .Input("resources: N * resource")
    .Attr("N: int >= 1")
    .Attr("root: int = 0")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Assigns rank `root`'s value of each variable to it on every rank; every rank
passes variables of the same dtypes and shapes, in the same order.
)doc");

REGISTER_OP("VfAllgather")
    .Input("input: T")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int32, int64, uint8, int8, bool}")
    .Attr("stages: int = 0")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle in;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &in));
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->ReplaceDim(in, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
The inputs of all ranks concatenated along dimension 0, in rank order. Ranks may
pass different sizes of dimension 0; the other dimensions must agree. `stages` > 0:
over the ranks of this rank's pipeline stage only (as VfAllreduce).
)doc");

REGISTER_OP("VfCheck")
    .Attr("fingerprint: string")
    .Attr("what: string = ''")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Fails on every rank unless every rank's `fingerprint` is the same; `what` names
what the fingerprint identifies in the error.
)doc");

REGISTER_OP("VfRank")
    .Attr("stages: int = 0")
    .Output("rank: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("This process's rank in the communicator (`stages` > 0: in its pipeline stage's).");

REGISTER_OP("VfSize")
    .Attr("stages: int = 0")
    .Output("size: int32")
    .SetIsStateful()
    .SetShapeFn(shape_inference::ScalarShape)
    .Doc("The number of ranks in the communicator (`stages` > 0: in its pipeline stage's).");

REGISTER_OP("VfExactAdd")
    .Input("sum: int64")
    .Input("values: N * T")
    .Output("output: int64")
    .Attr("N: int >= 1")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn(shape_inference::UnchangedShape)
    .Doc(R"doc(
`sum` plus the exact fixed-point words of `values` (n values in all): n high words,
n low words, and a last word counting the calls that saw a value that is not finite
or reaches 2^31 in magnitude. Sums of words are exact, whatever the order.
)doc");

REGISTER_OP("VfExactValue")
    .Input("sum: int64")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double}")
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      shape_inference::ShapeHandle in;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 1, &in));
      const int64_t words = c->Value(c->Dim(in, 0));
      c->set_output(0, c->Vector(words < 0 ? shape_inference::InferenceContext::kUnknownDim : words / 2));
      return absl::OkStatus();
    })
    .Doc(R"doc(
The n values of `sum`, words VfExactAdd summed (hi * 2^-20 + lo * 2^-60, rounded once
to T); all NaN when its last word counts a value outside the limit.
)doc");

REGISTER_OP("VfSend")
    .Input("input: T")
    .Input("tag: int32")
    .Attr("T: {half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16, bool}")
    .Attr("stage: int")
    .Attr("stages: int")
    .SetIsStateful()
    .SetShapeFn(shape_inference::NoOutputs)
    .Doc(R"doc(
Sends `input` to the rank running pipeline stage `stage` of this rank's group of
`stages` consecutive ranks, as message `tag`; a VfRecv with the same tag there
receives it. Asynchronous: the message is posted at once, and a thread of its own waits
for its delivery.
)doc");

REGISTER_OP("VfRecv")
    .Input("tag: int32")
    .Output("output: T")
    .Attr("T: {half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16, bool}")
    .Attr("stage: int")
    .Attr("stages: int")
    .Attr("shape: shape")
    .SetIsStateful()
    .SetShapeFn([](shape_inference::InferenceContext* c) {
      ::tensorflow::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
      shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      c->set_output(0, out);
      return absl::OkStatus();
    })
    .Doc(R"doc(
Receives message `tag` from the rank running pipeline stage `stage` of this rank's
group of `stages` consecutive ranks (its dtype and shape travel with it; `shape`
is what the graph knows of it statically).
)doc");

#define VF_REGISTER_ALLREDUCE(T)                                             \
  REGISTER_KERNEL_BUILDER(                                                   \
      Name("VfAllreduce").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
      AllreduceOp<T>);
VF_REGISTER_ALLREDUCE(Eigen::half)
VF_REGISTER_ALLREDUCE(Eigen::bfloat16)
VF_REGISTER_ALLREDUCE(float)
VF_REGISTER_ALLREDUCE(double)
VF_REGISTER_ALLREDUCE(int32_t)
VF_REGISTER_ALLREDUCE(int64_t)
#undef VF_REGISTER_ALLREDUCE

#define VF_REGISTER_BYTES(OP, KERNEL, T)                              \
  REGISTER_KERNEL_BUILDER(                                            \
      Name(OP).Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), KERNEL);
#define VF_REGISTER_BYTES_ALL(OP, KERNEL)  \
  VF_REGISTER_BYTES(OP, KERNEL, Eigen::half)     \
  VF_REGISTER_BYTES(OP, KERNEL, Eigen::bfloat16) \
  VF_REGISTER_BYTES(OP, KERNEL, float)           \
  VF_REGISTER_BYTES(OP, KERNEL, double)          \
  VF_REGISTER_BYTES(OP, KERNEL, int32_t)         \
  VF_REGISTER_BYTES(OP, KERNEL, int64_t)         \
  VF_REGISTER_BYTES(OP, KERNEL, uint8_t)         \
  VF_REGISTER_BYTES(OP, KERNEL, int8_t)          \
  VF_REGISTER_BYTES(OP, KERNEL, bool)
VF_REGISTER_BYTES_ALL("VfBroadcast", BroadcastOp)
VF_REGISTER_BYTES_ALL("VfAllgather", AllgatherOp)
#undef VF_REGISTER_BYTES_ALL
#undef VF_REGISTER_BYTES

REGISTER_KERNEL_BUILDER(Name("VfBroadcastVariables").Device(::tensorflow::DEVICE_CPU),
                        BroadcastVariablesOp);
REGISTER_KERNEL_BUILDER(Name("VfCheck").Device(::tensorflow::DEVICE_CPU), CheckOp);
REGISTER_KERNEL_BUILDER(Name("VfRank").Device(::tensorflow::DEVICE_CPU), CommInfoOp<true>);
REGISTER_KERNEL_BUILDER(Name("VfSize").Device(::tensorflow::DEVICE_CPU), CommInfoOp<false>);
REGISTER_KERNEL_BUILDER(Name("VfSend").Device(::tensorflow::DEVICE_CPU), SendOp);
REGISTER_KERNEL_BUILDER(Name("VfRecv").Device(::tensorflow::DEVICE_CPU), RecvOp);
#define VF_EXACT_KERNEL(T) \
  REGISTER_KERNEL_BUILDER(Name("VfExactAdd").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          ExactAddOp<T>); \
  REGISTER_KERNEL_BUILDER(Name("VfExactValue").Device(::tensorflow::DEVICE_CPU).TypeConstraint<T>("T"), \
                          ExactValueOp<T>);
VF_EXACT_KERNEL(Eigen::half)
VF_EXACT_KERNEL(Eigen::bfloat16)
VF_EXACT_KERNEL(float)
VF_EXACT_KERNEL(double)
#undef VF_EXACT_KERNEL

}  // namespace vfgraph

// Chooses the communicator every kernel uses from now on, given its Fortran
// handle (mpi4py: comm.py2f()). Returns 0 on success, -1 when MPI is not
// initialised, -2 for MPI_COMM_NULL, otherwise the MPI error code.
extern "C" __attribute__((visibility("default"))) int vf_mpi_set_comm(int fortran_handle) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return -1;
  MPI_Comm comm = MPI_Comm_f2c(static_cast<MPI_Fint>(fortran_handle));
  if (comm == MPI_COMM_NULL) return -2;
  std::lock_guard<std::mutex> lock(vfgraph::CollectiveMutex());
  const int rc = MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return rc;
  vfgraph::CommState& state = vfgraph::State();
  state.comm = comm;
  state.user_comm = true;
  state.errhandler_set = true;
  if (state.stage_comm != MPI_COMM_NULL) MPI_Comm_free(&state.stage_comm);  // split another one
  if (state.replica_comm != MPI_COMM_NULL) MPI_Comm_free(&state.replica_comm);
  state.stages = 0;
  state.seq = state.stage_seq = state.replica_seq = 0;
  std::lock_guard<std::mutex> channels(vfgraph::ChannelMutex());
  vfgraph::Channels().clear();  // (a freed communicator's handle may come back for another)
  return 0;
}

// Splits the communicator in use into the ranks of each of `stages` pipeline
// stages (rank r joins stage r modulo `stages`: the same stage of every replica),
// for the ops whose `stages` attribute names that number. Every rank calls it,
// with the same `stages`. Returns 0 on success, -1 when MPI is not initialised,
// -3 when the ranks cannot form that many stages, otherwise the MPI error code.
extern "C" __attribute__((visibility("default"))) int vf_mpi_split_stages(int stages) {
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) return -1;
  std::lock_guard<std::mutex> lock(vfgraph::CollectiveMutex());
  vfgraph::CommState& state = vfgraph::State();
  MPI_Comm comm = state.user_comm ? state.comm : MPI_COMM_WORLD;
  int rank = 0, size = 0;
  int rc = MPI_Comm_rank(comm, &rank);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Comm_size(comm, &size);
  if (rc != MPI_SUCCESS) return rc;
  if (stages < 1 || size % stages != 0) return -3;
  MPI_Comm split = MPI_COMM_NULL;
  rc = MPI_Comm_split(comm, rank % stages, rank, &split);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Comm_set_errhandler(split, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return rc;
  MPI_Comm replica = MPI_COMM_NULL;  // rank r - r % stages + k runs stage k of this replica
  rc = MPI_Comm_split(comm, rank / stages, rank, &replica);
  if (rc != MPI_SUCCESS) return rc;
  rc = MPI_Comm_set_errhandler(replica, MPI_ERRORS_RETURN);
  if (rc != MPI_SUCCESS) return rc;
  if (state.stage_comm != MPI_COMM_NULL) MPI_Comm_free(&state.stage_comm);
  if (state.replica_comm != MPI_COMM_NULL) MPI_Comm_free(&state.replica_comm);
  state.stage_comm = split;
  state.replica_comm = replica;
  state.stages = stages;
  state.stage_seq = state.replica_seq = 0;
  std::lock_guard<std::mutex> channels(vfgraph::ChannelMutex());
  vfgraph::Channels().clear();  // (a freed communicator's handle may come back for another)
  return 0;
}

// Makes every wait for other ranks give up (on != 0: the job lost a rank) or wait again.
extern "C" __attribute__((visibility("default"))) void vf_mpi_abandon(int on) {
  vfgraph::Abandoned().store(on != 0);
}

// Nanoseconds this process has spent in vfgraph's collectives so far (BlockedNanos).
extern "C" __attribute__((visibility("default"))) int64_t vf_mpi_blocked_ns() {
  return vfgraph::BlockedNanos().load();
}

// VfAllreduce's counters (AllreduceStats), in this order, into `out` (at most `n` of them):
// calls, total_ns, copy_ns, arrive_ns, reduce_ns, bytes, tests, yields, sleeps, slept_ns.
// Returns how many there are.
extern "C" __attribute__((visibility("default"))) int vf_mpi_allreduce_stats(int64_t* out, int n) {
  const vfgraph::AllreduceStats& s = vfgraph::Stats();
  const int64_t values[] = {s.calls.load(), s.total_ns.load(), s.copy_ns.load(), s.arrive_ns.load(),
                            s.reduce_ns.load(), s.bytes.load(), s.tests.load(), s.yields.load(),
                            s.sleeps.load(), s.slept_ns.load()};
  const int count = static_cast<int>(sizeof(values) / sizeof(values[0]));
  for (int i = 0; i < std::min(n, count); ++i) out[i] = values[i];
  return count;
}

namespace {
struct sigaction previous_handlers[2];  // SIGINT's and SIGTERM's before vf_mpi_watch

// A stop request: noted for the waits (which give up their grace time after it), then passed to
// the handler it replaced (Python's, which asks training to stop after the step). A second
// one, a second or more after the first, while a wait is in progress ends the process at once.
void OnStopSignal(int signum, siginfo_t* info, void* context) {
  vfgraph::WatchState& watch = vfgraph::Watch();
  const int64_t now = vfgraph::MonotonicNs();
  int64_t first = 0;
  if (!watch.stop_at.compare_exchange_strong(first, now) && now - first > 1'000'000'000 &&
      watch.waiting.load() > 0) {
    static const char kLine[] = "vfgraph: a second stop request while waiting for other ranks: ending at once\n";
    (void)!write(2, kLine, sizeof(kLine) - 1);
    _exit(130);
  }
  const struct sigaction& old = previous_handlers[signum == SIGINT ? 0 : 1];
  if (old.sa_flags & SA_SIGINFO) {
    if (old.sa_sigaction != nullptr) old.sa_sigaction(signum, info, context);
  } else if (old.sa_handler != SIG_DFL && old.sa_handler != SIG_IGN && old.sa_handler != nullptr) {
    old.sa_handler(signum);
  }
}
}  // namespace

// The watchdog's limits in seconds (0: none): a wait prints one line past `warning` and
// gives up past `timeout`, and `grace` after a stop request (or its own start, if later);
// clears an earlier stop request or stall. `signals` != 0 (from the
// main thread, after the process's own handlers): SIGINT and SIGTERM are noted as stop
// requests for the waits first, then handled as before (restoring those handlers with
// signal.signal removes this again).
extern "C" __attribute__((visibility("default"))) void vf_mpi_watch(double warning, double timeout, double grace,
                                                                    int signals) {
  vfgraph::WatchState& watch = vfgraph::Watch();
  watch.grace_ns.store(static_cast<int64_t>(grace * 1e9));
  watch.warning_ns.store(static_cast<int64_t>(warning * 1e9));
  watch.timeout_ns.store(static_cast<int64_t>(timeout * 1e9));
  watch.stop_at.store(0);
  watch.halt.store(0);
  {
    std::lock_guard<std::mutex> lock(watch.mu);
    watch.stall_line.clear();
  }
  if (!signals) return;
  const int which[2] = {SIGINT, SIGTERM};
  for (int k = 0; k < 2; ++k) {
    struct sigaction action = {};
    action.sa_sigaction = OnStopSignal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    struct sigaction old = {};
    if (sigaction(which[k], &action, &old) == 0 && old.sa_sigaction != OnStopSignal) previous_handlers[k] = old;
  }
}

// The training step the waits name from now on (-1: none).
extern "C" __attribute__((visibility("default"))) void vf_mpi_set_step(int64_t step) {
  vfgraph::Watch().step.store(step);
}
