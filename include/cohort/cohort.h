// cohort: distributed training for libtorch's C++ frontend. One header for the whole library.
//
//   #include <cohort/cohort.h>
//   auto job = cohort::Job::fromEnvironment();               // TF_CONFIG | torchrun | mpirun | Slurm
//   cohort::DataParallel dp(job, *net);                      // any torch::nn::Module
//   cohort::DistributedSampler sampler(dataset.size(), job); // this rank's examples, per epoch
//
// docs/LIBRARY.md is the guide.
#pragma once

#include <cohort/autocast.h>
#include <cohort/averaging.h>
#include <cohort/checkpoint.h>
#include <cohort/cluster.h>
#include <cohort/communicator.h>
#include <cohort/data.h>
#include <cohort/data_parallel.h>
#include <cohort/device.h>
#include <cohort/env.h>
#include <cohort/error.h>
#include <cohort/export.h>
#include <cohort/gossip.h>
#include <cohort/host_port.h>
#include <cohort/idx.h>
#include <cohort/job.h>
#include <cohort/metrics.h>
#include <cohort/models.h>
#include <cohort/optim.h>
#include <cohort/parameter_server.h>
#include <cohort/pipeline.h>
#include <cohort/rendezvous.h>
#include <cohort/replicas.h>
#include <cohort/sampler.h>
#include <cohort/tensor_parallel.h>
