// ParameterServerClient's push (parameter_server_internal.h): what one step sends each shard (the
// gradients or the local optimizer's change, dense pieces and a row-sparse table's touched rows,
// framed or encoded) and what it takes back from the replies.
#include "schemes/parameter_server_internal.h"

#include "base/clock.h"
#include "base/launcher_channel.h"

#include "compress/codec.h"
#include "ps/client.h"
#include "ps/layout.h"
#include "ps/service.h"
#include "ps/wire.h"
#include "schemes/host_mirror.h"
#include "schemes/model_sync.h"
#include "schemes/ps_policy.h"

#include <cohort/error.h>
#include <cohort/job.h>
#include <cohort/models.h>
#include <cohort/parameter_server.h>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

namespace cohort {

using parameter_server_internal::check;
using parameter_server_internal::forEachShard;
using parameter_server_internal::PsContext;

void ParameterServerClient::Impl::snapshot() {
  if (c_.options.push != PsPush::kUpdates) return;
  torch::NoGradGuard noGrad;
  if (before_.empty()) {
    for (const auto& p : params_) before_.push_back(p.detach().clone());
  } else {
    for (size_t i = 0; i < params_.size(); ++i) before_[i].copy_(params_[i]);
  }
}

ParameterServerStep ParameterServerClient::Impl::push(int64_t samples) {
  checkCanPush();
  const Outgoing out = outgoing();
  const auto commStart = Clock::now();
  std::vector<ps::wire::PushReply> replies(clients_.size());
  std::vector<int64_t> sent(clients_.size(), 0);
  const bool compress = !encoders_.empty() && steps_ >= c_.options.codecWarmupSteps;
  // The next step's rows, when every table's are known; otherwise the reply brings every row.
  bool wantRows = anyRowSparse_;
  for (size_t i = 0; i < params_.size(); ++i) wantRows = wantRows && (!rowSparse_[i] || nextRows_[i].defined());
  messages_.resize(clients_.size());
  forEachShard(clients_.size(), [&](size_t s) {
    ps::wire::PushRequest request;
    request.set_protocol(ps::kProtocolVersion);
    request.set_worker(uint32_t(c_.rank));
    request.set_pulled_version(versions_[s]);
    request.set_clock(clock_);
    request.set_samples(samples);
    request.set_want_values(true);
    request.set_row_sparse(anyRowSparse_);
    request.set_want_all_rows(anyRowSparse_ && !wantRows);
    if (!compress && !anyRowSparse_) {
      sent[s] = pushFramed(s, request, out, &replies[s]);
      return;
    }
    sent[s] = addValues(s, out, compress, request) + addRows(s, out.rows, compress, wantRows, request);
    check(clients_[s]->push(request, &replies[s]), c_.shards[s], "Push");
    if (anyRowSparse_ && wantRows) {
      loadRows(s, replies[s].version(), replies[s].values(), replies[s].rows());
    } else {
      load(s, replies[s].version(), replies[s].values());
    }
  });
  for (auto& next : nextRows_) next = torch::Tensor();
  if (mirror_) mirror_->toDevice();  // the next step's parameters, without blocking the host
  snapshot();
  const double commWaitSeconds = secondsSince(commStart);
  ++clock_;
  ++steps_;
  ParameterServerStep stats = stepOf(replies, sent);
  stats.commWaitSeconds = commWaitSeconds;
  return stats;
}

void ParameterServerClient::Impl::checkCanPush() const {
  COHORT_CHECK(!finished_, InvalidArgument, "cohort::ParameterServerClient::step() after finish()");
  if (c_.options.push == PsPush::kUpdates) return;
  bool any = false;
  for (const auto& p : modelParams_) any = any || p.grad().defined();
  COHORT_CHECK(any, InvalidArgument,
               "cohort::ParameterServerClient::step() before backward(): no parameter has a gradient to push");
}

ParameterServerClient::Impl::Outgoing ParameterServerClient::Impl::outgoing() {
  torch::NoGradGuard noGrad;
  Outgoing out;
  out.rows.resize(params_.size());
  out.noGradient.assign(params_.size(), false);
  if (mirror_ && c_.options.push == PsPush::kUpdates) {
    mirror_->toHost();  // the change the local optimizer made on the device
  } else if (mirror_) {
    // The dense gradients leave the device once, together; the tables' rows below.
    std::vector<torch::Tensor> grads;
    for (size_t i = 0; i < modelParams_.size(); ++i) {
      grads.push_back(rowSparse_[i] ? torch::Tensor() : modelParams_[i].grad());
    }
    gradMirror_->toHost(grads);
    mirror_->awaitDevice();  // the reply is written into the parameters' host views
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (rowSparse_[i]) {
      const auto& g = modelParams_[i].grad();
      if (g.defined()) {
        auto [ids, values] = gradientRows(g);
        out.rows[i] = {ids.to(torch::kCPU), values.to(torch::kCPU)};  // the same tensors on the CPU
      } else {
        out.rows[i] = {torch::empty({0}, torch::kInt64), torch::empty({0, params_[i].size(1)})};
      }
      out.send.emplace_back();
    } else if (c_.options.push == PsPush::kUpdates) {
      out.send.push_back((params_[i].detach() - before_[i]).contiguous());
    } else if (gradMirror_) {
      out.noGradient[i] = !modelParams_[i].grad().defined();
      out.send.push_back(gradMirror_->views()[i]);
    } else {
      const auto& g = params_[i].grad();
      out.noGradient[i] = !g.defined();
      out.send.push_back(g.defined() ? g.contiguous() : torch::zeros_like(params_[i]));
    }
  }
  return out;
}

int64_t ParameterServerClient::Impl::addValues(size_t s, const Outgoing& out, bool compress,
                                               ps::wire::PushRequest& request) {
  const std::vector<torch::Tensor>& send = out.send;
  if (compress && !denseSpecs_[s].empty()) {
    float* flat = flat_[s].data();
    // The pieces without a gradient, as [start, end) in flat_. They travel as zeros in
    // the message and are named beside it; the shard ignores their part, so the residual the
    // encoder kept for them is put back, to be sent once they have a gradient again.
    std::vector<std::pair<size_t, size_t>> absent;
    for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
      const ps::Piece* p = shardPieces_[s][k];
      if (anyRowSparse_ && p->rowDim > 0) continue;
      std::memcpy(flat, send[p->param].data_ptr<float>() + p->offset, p->numel * sizeof(float));
      if (out.noGradient[p->param]) {
        const size_t start = size_t(flat - flat_[s].data());
        absent.emplace_back(start, start + p->numel);
        ps::setNoGradient(request.add_values(), specs_[s][k]);
      }
      flat += p->numel;
    }
    std::vector<float> kept;
    if (!absent.empty()) kept.assign(encoders_[s].residual().begin(), encoders_[s].residual().end());
    encoders_[s].encode(flat_[s], messages_[s]);
    if (!absent.empty() && !kept.empty()) {
      std::vector<float> residual(encoders_[s].residual().begin(), encoders_[s].residual().end());
      for (const auto& [start, end] : absent)
        std::copy(kept.begin() + ptrdiff_t(start), kept.begin() + ptrdiff_t(end), residual.begin() + ptrdiff_t(start));
      encoders_[s].setResidual(residual);
    }
    request.set_compressed(messages_[s].data(), messages_[s].size());
    return int64_t(messages_[s].size());
  }
  for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
    const ps::Piece& p = *shardPieces_[s][k];
    if (anyRowSparse_ && p.rowDim > 0) continue;
    if (out.noGradient[p.param]) {
      ps::setNoGradient(request.add_values(), specs_[s][k]);
    } else {
      ps::setTensor(request.add_values(), specs_[s][k], send[p.param].data_ptr<float>() + p.offset);
    }
  }
  return payloadBytes(request.values());
}

int64_t ParameterServerClient::Impl::addRows(size_t s, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& rows,
                                             bool compress, bool wantRows, ps::wire::PushRequest& request) {
  int64_t bytes = 0;
  for (size_t k = 0; anyRowSparse_ && k < shardPieces_[s].size(); ++k) {
    const ps::Piece& p = *shardPieces_[s][k];
    if (p.rowDim == 0) continue;
    const auto [begin, end] = rowRange(rows[p.param].first, p);
    if (end > begin) {
      ps::wire::Rows* r = request.add_rows();
      setPushedRows(r, p, rows[p.param].first, rows[p.param].second, begin, end, compress);
      bytes += int64_t(r->ByteSizeLong());
    }
    if (wantRows) {
      const auto [from, to] = rowRange(nextRows_[p.param], p);
      ps::wire::Rows* want = request.add_want_rows();
      want->set_key(p.key);
      const int64_t* ids = nextRows_[p.param].data_ptr<int64_t>();
      const int64_t first = int64_t(p.offset / p.rowDim);
      for (int64_t j = from; j < to; ++j) want->add_rows(uint32_t(ids[j] - first));
      bytes += int64_t(want->ByteSizeLong());
    }
  }
  return bytes;
}

ParameterServerStep ParameterServerClient::Impl::stepOf(const std::vector<ps::wire::PushReply>& replies,
                                                        const std::vector<int64_t>& sent) {
  ParameterServerStep stats;
  const auto& first = replies[0];
  stats.samples = std::max<int64_t>(0, first.samples_total() - samplesSeen_);
  samplesSeen_ = std::max(samplesSeen_, first.samples_total());
  for (size_t s = 0; s < replies.size(); ++s) {
    stats.bytesSent += sent[s];
    stats.bytesReceived += payloadBytes(replies[s].values());
    for (const auto& r : replies[s].rows()) stats.bytesReceived += int64_t(r.ByteSizeLong());
  }
  stats.staleness = int64_t(first.staleness());
  stats.applied = first.applied();
  stats.serverWaitSeconds = first.wait_s();
  if (!first.applied()) stats.dropped = first.dropped();
  for (const auto& reply : replies) stopJob_ = stopJob_ || reply.stop_job();
  stats.stopJob = stopJob_;
  return stats;
}

int64_t ParameterServerClient::Impl::pushFramed(size_t s, const ps::wire::PushRequest& header, const Outgoing& out,
                                                ps::wire::PushReply* reply) {
  const std::vector<torch::Tensor>& send = out.send;
  ps::FramedPush push;
  push.request = header;
  std::vector<ps::FrameTarget> into;
  int64_t bytes = 0;
  for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
    const ps::Piece& p = *shardPieces_[s][k];
    ps::wire::Tensor* t = push.request.add_values();
    into.push_back(
        {.key = p.key, .values = std::span<float>(params_[p.param].data_ptr<float>() + p.offset, size_t(p.numel))});
    if (out.noGradient[p.param]) {
      ps::setNoGradient(t, specs_[s][k]);  // no floats in the payload
      push.payload.emplace_back();
      continue;
    }
    t->set_key(p.key);
    t->set_numel(p.numel);
    t->set_dtype(ps::wire::FLOAT32);
    push.payload.emplace_back(send[p.param].data_ptr<float>() + p.offset, size_t(p.numel));
    bytes += int64_t(p.numel * sizeof(float));
  }
  push.keepAlive = std::make_shared<const std::vector<torch::Tensor>>(send);
  check(clients_[s]->pushFramed(push, into, reply), c_.shards[s], "Push");
  versions_[s] = reply->version();
  return bytes;
}

std::pair<int64_t, int64_t> ParameterServerClient::Impl::rowRange(const torch::Tensor& ids, const ps::Piece& p) {
  const int64_t* data = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel();
  const int64_t first = int64_t(p.offset / p.rowDim);
  const int64_t last = first + int64_t(p.numel / p.rowDim);
  return {std::lower_bound(data, data + n, first) - data, std::lower_bound(data, data + n, last) - data};
}

void ParameterServerClient::Impl::setPushedRows(ps::wire::Rows* out, const ps::Piece& p, const torch::Tensor& ids,
                                                const torch::Tensor& values, int64_t begin, int64_t end,
                                                bool compress) const {
  out->set_key(p.key);
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t first = int64_t(p.offset / p.rowDim);
  for (int64_t j = begin; j < end; ++j) out->add_rows(uint32_t(id[j] - first));
  const size_t count = size_t(end - begin) * p.rowDim;
  const std::span<const float> v(values.data_ptr<float>() + size_t(begin) * p.rowDim, count);
  if (compress && codec_.sixteenBit()) {
    std::vector<uint16_t> bits(count);
    if (codec_.kind == compress::CodecKind::Fp16) {
      compress::floatsToHalf(v, bits);
      out->set_dtype(ps::wire::FLOAT16);
    } else {
      compress::floatsToBf16(v, bits);
      out->set_dtype(ps::wire::BFLOAT16);
    }
    out->set_data(reinterpret_cast<const char*>(bits.data()), count * sizeof(uint16_t));
    return;
  }
  out->set_dtype(ps::wire::FLOAT32);
  out->set_data(reinterpret_cast<const char*>(v.data()), count * sizeof(float));
}

void ParameterServerClient::Impl::loadRows(size_t s, uint64_t version,
                                           const google::protobuf::RepeatedPtrField<ps::wire::Tensor>& values,
                                           const google::protobuf::RepeatedPtrField<ps::wire::Rows>& rows) {
  check(ps::checkTensors(values, denseSpecs_[s], false, "reply"), c_.shards[s], "Push");
  check(ps::checkRows(rows, specs_[s], true, false, "reply"), c_.shards[s], "Push");
  torch::NoGradGuard noGrad;
  int next = 0;
  std::vector<float> scratch;
  for (size_t k = 0; k < shardPieces_[s].size(); ++k) {
    const ps::Piece& p = *shardPieces_[s][k];
    float* param = params_[p.param].data_ptr<float>() + p.offset;
    if (p.rowDim == 0) {
      std::memcpy(param, values.Get(next++).data().data(), p.numel * sizeof(float));
      continue;
    }
    for (const auto& r : rows) {
      if (r.key() != p.key) continue;
      ps::rowFloats(r, scratch);
      for (int j = 0; j < r.rows_size(); ++j) {
        std::memcpy(param + size_t(r.rows(j)) * p.rowDim, scratch.data() + size_t(j) * p.rowDim,
                    p.rowDim * sizeof(float));
      }
    }
  }
  versions_[s] = version;
}

void ParameterServerClient::Impl::prefetchRows(const torch::Tensor& param, const torch::Tensor& ids) {
  for (size_t i = 0; i < modelParams_.size(); ++i) {
    if (!modelParams_[i].is_same(param)) continue;
    COHORT_CHECK(rowSparse_[i], InvalidArgument,
                 "cohort::ParameterServerClient::prefetchRows: the parameter is not a sparse embedding table");
    // On the CPU: the push names them (a no-op for ids there already).
    torch::Tensor rows =
        std::get<0>(torch::_unique(ids.reshape({-1}).to(torch::kInt64), /*sorted=*/true)).to(torch::kCPU);
    COHORT_CHECK(rows.numel() == 0 || (rows[0].item<int64_t>() >= 0 && rows[-1].item<int64_t>() < param.size(0)),
                 InvalidArgument, "cohort::ParameterServerClient::prefetchRows: row ids outside the table of ",
                 param.size(0), " rows");
    nextRows_[i] = rows.contiguous();
    return;
  }
  throw InvalidArgument("cohort::ParameterServerClient::prefetchRows: the tensor is not a parameter of the module");
}

}  // namespace cohort
