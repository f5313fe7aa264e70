// refit: everything an application needs, behind one include.
//
//   #include <refit/refit.h>          // Bazel: deps = ["@refit//:refit"]
//                                     // pkg-config: pkg-config --cflags --libs refit
//
// Worker side (an inference server): a model_target (tensor_map_target is ready
// made), a control::worker_host serving vLLM's weight-transfer verbs on the
// server's own event loop. Trainer side: a weight_sender from engine_factory and
// a control::worker_group that drives the workers' verbs. The individual headers
// (<refit/engine.h>, <refit/control/worker_host.h>, ...) can be included instead.
#pragma once

#include <refit/config.h>
#include <refit/control/client.h>
#include <refit/control/worker_group.h>
#include <refit/control/worker_host.h>
#include <refit/dtype.h>
#include <refit/engine.h>
#include <refit/error.h>
#include <refit/factory.h>
#include <refit/integrity/auth.h>
#include <refit/integrity/fingerprint.h>
#include <refit/metadata.h>
#include <refit/model/tensor_map_target.h>
#include <refit/model/tensor_memory.h>
#include <refit/session.h>
#include <refit/tensor.h>
#include <refit/trainer.h>
