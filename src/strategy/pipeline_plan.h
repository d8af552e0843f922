// The pipeline's plans, torch-free: which micro-batch each stage runs forward or backward in what
// order (GPipe, 1F1B), and where the model is cut (by a list, or balanced by measured cost).
#pragma once

#include <string>
#include <vector>

namespace cohort {

enum class PipeSchedule { kGpipe, kOneFOneB };

// "gpipe" or "1f1b"; throws InvalidArgument otherwise.
PipeSchedule parseSchedule(const std::string& name);

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

// Layers per stage from "L1,L2,...": one positive count per stage, adding up to `layers`.
// Throws InvalidArgument naming what is wrong.
std::vector<int> parsePartition(const std::string& text, int stages, int layers);

// Layers per stage: contiguous groups, at least one layer each, that minimize the largest sum of
// `costs` in a stage (exact, by dynamic programming). `cutAfter[j]` says whether the model may be
// cut after layer j (empty: anywhere). Throws InvalidArgument when no such cut exists.
std::vector<int> balanceStages(const std::vector<double>& costs, int stages, const std::vector<bool>& cutAfter = {});

// "4,4" for {4, 4}.
std::string joinCounts(const std::vector<int>& counts);

}  // namespace cohort
