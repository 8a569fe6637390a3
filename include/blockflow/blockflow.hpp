#pragma once
/// @file
/// @brief The core of BlockFlow: blocks, paths, sessions and the in-process channel.

#include <blockflow/block.hpp>
#include <blockflow/block_registry.hpp>
#include <blockflow/remote_site.hpp>
#include <blockflow/channel.hpp>
#include <blockflow/inproc_channel.hpp>
#include <blockflow/metrics.hpp>
#include <blockflow/path.hpp>
#include <blockflow/result.hpp>
#include <blockflow/session.hpp>
#include <blockflow/tensor.hpp>
#include <blockflow/torchscript_block.hpp>
#include <blockflow/version.hpp>
#include <blockflow/log.hpp>
