// Progress on stderr: a bar with rate and ETA on a terminal, a line every few seconds in a pipe.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace cohort {

class Progress {
 public:
  enum class Style { kBar, kLines, kOff };

  // totalSteps may be 0 when unknown. firstStep: the step a resumed run starts after (the ETA is
  // timed on the steps this process made).
  Progress(Style style, int64_t totalSteps, double lineIntervalSeconds, int64_t firstStep = 0);

  // Chooses kBar when stderr is a terminal, else kLines.
  static Style autoStyle();

  void update(int64_t step, int64_t epoch, double loss, double samplesPerSecond);
  // Prints a message on its own line without breaking the bar.
  void message(const std::string& text);
  void finish();

 private:
  void draw(bool force);

  Style style_;
  int64_t total_;
  int64_t first_;
  double interval_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point lastDraw_;
  int64_t step_ = 0;
  int64_t epoch_ = 0;
  double loss_ = 0;
  double rate_ = 0;
  bool barShown_ = false;
};

}  // namespace cohort
