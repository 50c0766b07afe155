#pragma once

/// The public API of consort: include this one header.

#include <consort/checkpoint.hpp>
#include <consort/clock_offset.hpp>
#include <consort/cluster.hpp>
#include <consort/cross_device_ops.hpp>
#include <consort/dataset.hpp>
#include <consort/device.hpp>
#include <consort/elastic.hpp>
#include <consort/error.hpp>
#include <consort/future.hpp>
#include <consort/nest.hpp>
#include <consort/ops.hpp>
#include <consort/optimizer.hpp>
#include <consort/per_replica.hpp>
#include <consort/reduce_op.hpp>
#include <consort/regroup.hpp>
#include <consort/replica_context.hpp>
#include <consort/stragglers.hpp>
#include <consort/strategy.hpp>
#include <consort/tensor.hpp>
#include <consort/variable.hpp>
