#pragma once
/// @file
/// @brief The core of BlockFlow: blocks, paths, sessions and the in-process channel.

#include <blockflow/core/block.hpp>
#include <blockflow/core/block_registry.hpp>
#include <blockflow/core/remote_site.hpp>
#include <blockflow/channel/channel.hpp>
#include <blockflow/channel/inproc_channel.hpp>
#include <blockflow/core/metrics.hpp>
#include <blockflow/core/path.hpp>
#include <blockflow/core/result.hpp>
#include <blockflow/core/session.hpp>
#include <blockflow/core/tensor.hpp>
#include <blockflow/core/torchscript_block.hpp>
#include <blockflow/core/version.hpp>
#include <blockflow/core/log.hpp>
