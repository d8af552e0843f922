// Measurements `cohort simulate --calibrate` takes without torch: a, b over loopback between two
// processes on real TCP sockets, and g, the CPU cost of summing float32 buffers.
#pragma once

namespace cohort::sim {

struct LinkProbe {
  double latencySeconds = 0;  // a: half the median round trip of a 1-byte message
  double secondsPerByte = 0;  // b: median seconds per byte of a 16 MB one-way transfer
};

// Forks a peer process that echoes on 127.0.0.1; every wait is bounded (timeoutSeconds). Throws
// CommError when the peer cannot be reached.
LinkProbe probeLoopback(double timeoutSeconds = 30);

// Seconds per byte of out += in over two float32 buffers of `bytes` (median of several passes).
double probeReduce(double bytes = 16 << 20);

// CPU seconds another process has run, all its threads together, those that have ended included
// (its CPU clock). Throws CommError when the process cannot be read.
double processCpuSeconds(int pid);

}  // namespace cohort::sim
