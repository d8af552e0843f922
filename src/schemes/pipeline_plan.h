// The pipeline's plans (include/cohort/pipeline.h), computed without torch: which micro-batch each
// stage runs forward or backward in what order (GPipe, 1F1B), where the model is cut (by a list,
// or balanced by measured cost), and how many micro-batches a batch is cut into.
#pragma once

#include <cohort/pipeline.h>

#include <cstdint>
#include <string>
#include <vector>

namespace cohort {

// "gpipe" or "1f1b"; throws InvalidArgument otherwise.
PipeSchedule parseSchedule(const std::string& name);
// "gpipe" or "1f1b".
std::string scheduleName(PipeSchedule schedule);

struct PipeOp {
  bool forward = true;
  int micro = 0;
};

// The order in which `stage` of `stages` runs the forward and backward passes of `micro`
// micro-batches. Every stage runs each micro-batch's forward before its backward, and the
// stages' orders fit together: a stage's forward of micro-batch i comes after the forward of i
// on the stage before it, its backward after the backward of i on the stage after it.
//   GPipe: F0 F1 ... F(M-1), then B0 B1 ... B(M-1): M micro-batches held at the peak.
//   1F1B (PipeDream-flush): stages-1-stage forwards to fill the pipe, then one forward and one
//   backward in turn, then the remaining backwards: at most stages-stage micro-batches held.
std::vector<PipeOp> makeSchedule(PipeSchedule schedule, int stages, int stage, int micro);

// The largest number of micro-batches whose forward has run and whose backward has not.
int peakInFlight(const std::vector<PipeOp>& ops);

// Layers per stage of a given partition (kLayers; auto and split are refused): one positive count
// per stage, adding up to `layers`. Throws InvalidArgument naming what is wrong. With `splits`,
// splits[s] is the C of a stage's "L+C" (it also computes the first C output channels of the next
// stage's first layer, a split layer counted in the next stage; 0: none), splits[S-1] always 0.
// Without `splits`, a "+C" is refused.
std::vector<int> partitionCut(const PipelinePartition& partition, int stages, int layers,
                              std::vector<int>* splits = nullptr);

// "2+20,6" for counts {2, 6} and splits {20, 0}; "2,6" without splits.
std::string joinCut(const std::vector<int>& counts, const std::vector<int>& splits);

struct SplitCut {
  std::vector<int> counts;  // layers per stage; a split layer counts in the later stage
  std::vector<int> splits;  // per stage: output channels of the next stage's first layer computed here
  double slowest = 0;       // the predicted cost of the slowest stage
};

// --partition split: as balanceStages, but a stage may also end inside a layer j that
// `channels[j]` > 0 marks as splittable (its output channels), taking its first C channels, the
// next stage the others; the cost of a part is costs[j] * C / channels[j]. Every stage keeps at
// least one whole layer or a split layer's second part, each layer is split at most once, and C
// runs over every channel up to 64 channels and over 64 evenly spaced counts above. A split cut is
// taken only when its slowest stage is below `gain` times that of the best whole-layer cut (split
// layers cost more messages); otherwise the whole-layer cut is returned (splits all 0).
SplitCut balanceStagesSplit(const std::vector<double>& costs, int stages, const std::vector<bool>& cutAfter,
                            const std::vector<int64_t>& channels, double gain = 0.95);

// Layers per stage: contiguous groups, at least one layer each, that minimize the largest sum of
// `costs` in a stage (exact, by dynamic programming). `cutAfter[j]` says whether the model may be
// cut after layer j (empty: anywhere). Throws InvalidArgument when no such cut exists.
std::vector<int> balanceStages(const std::vector<double>& costs, int stages, const std::vector<bool>& cutAfter = {});

// --micro-batches: "auto" (returns 0, kAutoMicroBatches) or a count in [1, batch]. Throws
// InvalidArgument naming the problem (zero, not a number, more than the batch).
int parseMicroBatches(const std::string& text, int64_t batch);

// What a micro-batch costs, measured at start (seconds). A layer's forward+backward on m examples
// is modelled as perMicroBatch[j] + perExample[j] * m: the first part (per-op overheads) is paid
// once per micro-batch whatever its size. messageSeconds is the fixed cost of a micro-batch's
// messages between neighbouring stages (an activation one way and a gradient the other).
struct MicroBatchCosts {
  std::vector<double> perMicroBatch;  // per layer
  std::vector<double> perExample;     // per layer
  double messageSeconds = 0;
};

struct MicroBatchChoice {
  int microBatches = 1;
  std::vector<int> counts;      // layers per stage at that M
  double stepSeconds = 0;       // predicted
  double slotSeconds = 0;       // predicted time of the slowest stage on one micro-batch
  double fixedSeconds = 0;      // of that: the part paid per micro-batch (overheads + messages)
};

// The predicted step of M micro-batches under the cut `counts` (layers per stage).
MicroBatchChoice predictStep(const MicroBatchCosts& costs, int64_t batch, int stages, const std::vector<int>& counts,
                             int microBatches);

// --micro-batches auto: the M in [1, batch] that minimizes the predicted step time
// (M + S - 1) * slot(M), where slot(M) is the slowest stage's time on a micro-batch of
// ceil(batch / M) examples plus messageSeconds (S > 1). With per-micro-batch fixed cost F and
// work W per stage per batch this is about the largest M whose work per micro-batch W/M stays at
// least M/(S-1) times F (M ~ sqrt((S-1) W / F)): more micro-batches shrink the bubble, each one
// adds F. `counts` fixes the cut (empty: balanced at each M, as balanceStages). Ties go to the
// smaller M.
MicroBatchChoice chooseMicroBatches(const MicroBatchCosts& costs, int64_t batch, int stages,
                                    const std::vector<int>& counts, const std::vector<bool>& cutAfter = {});

// "4,4" for {4, 4}.
std::string joinCounts(const std::vector<int>& counts);

}  // namespace cohort
