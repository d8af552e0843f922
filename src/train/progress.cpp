#include "train/progress.h"

#include <unistd.h>

#include <cstdio>

namespace cohort {

namespace {

std::string clock(double seconds) {
  if (seconds < 0 || seconds > 1e7) return "?";
  const long s = long(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", s / 3600, (s / 60) % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%ld:%02ld", s / 60, s % 60);
  }
  return buf;
}

}  // namespace

Progress::Progress(Style style, int64_t totalSteps, double lineIntervalSeconds, int64_t firstStep)
    : style_(style),
      total_(totalSteps),
      first_(firstStep),
      interval_(lineIntervalSeconds),
      start_(std::chrono::steady_clock::now()),
      lastDraw_(start_) {}

Progress::Style Progress::autoStyle() { return ::isatty(STDERR_FILENO) ? Style::kBar : Style::kLines; }

void Progress::update(int64_t step, int64_t epoch, double loss, double samplesPerSecond) {
  step_ = step;
  epoch_ = epoch;
  loss_ = loss;
  rate_ = samplesPerSecond;
  draw(false);
}

void Progress::draw(bool force) {
  if (style_ == Style::kOff) return;
  const auto now = std::chrono::steady_clock::now();
  const double sinceDraw = std::chrono::duration<double>(now - lastDraw_).count();
  const double minInterval = style_ == Style::kBar ? 0.2 : interval_;
  if (!force && sinceDraw < minInterval) return;
  lastDraw_ = now;
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  const double eta = (total_ > 0 && step_ > first_) ? elapsed / double(step_ - first_) * double(total_ - step_) : -1;
  char line[256];
  if (style_ == Style::kBar) {
    constexpr int kWidth = 30;
    const double frac = total_ > 0 ? double(step_) / double(total_) : 0.0;
    std::string bar(kWidth, ' ');
    for (int i = 0; i < int(frac * kWidth); ++i) bar[size_t(i)] = '=';
    if (frac < 1.0 && int(frac * kWidth) < kWidth) bar[size_t(frac * kWidth)] = '>';
    std::snprintf(line, sizeof(line), "\r[%s] %3d%% step %lld/%lld epoch %lld loss %.4f %.0f samples/s ETA %s\x1b[K",
                  bar.c_str(), int(frac * 100), (long long)step_, (long long)total_,
                  (long long)epoch_ + 1, loss_, rate_, clock(eta).c_str());
    std::fputs(line, stderr);
    barShown_ = true;
  } else {
    std::snprintf(line, sizeof(line), "step %lld/%lld epoch %lld loss %.4f %.0f samples/s elapsed %s ETA %s\n",
                  (long long)step_, (long long)total_, (long long)epoch_ + 1, loss_, rate_,
                  clock(elapsed).c_str(), clock(eta).c_str());
    std::fputs(line, stderr);
  }
  std::fflush(stderr);
}

void Progress::message(const std::string& text) {
  if (style_ == Style::kOff) return;
  if (barShown_) std::fputs("\r\x1b[K", stderr);
  std::fprintf(stderr, "%s\n", text.c_str());
  if (barShown_) draw(true);
  std::fflush(stderr);
}

void Progress::finish() {
  if (style_ == Style::kOff) return;
  draw(true);
  if (style_ == Style::kBar) std::fputs("\n", stderr);
  std::fflush(stderr);
}

}  // namespace cohort
