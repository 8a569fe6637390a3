#pragma once
/// @file
/// @brief Moved to <blockflow/channel/curve.hpp> (CURVE secures every ZeroMQ TCP transport, the
/// channels' included); this header stays for one release.
#include <blockflow/channel/curve.hpp>
