#pragma once
// Key pairs for the CURVE tests: a scratch directory of `.key`/`.key_secret` files, removed at the
// end, and the ServerSecurity/ClientSecurity that name them.

#include "test_util.hpp"

#include <blockflow/channel/curve.hpp>

#include <fmt/format.h>

#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

namespace blockflow::test {

/// A pair per name in `pairs` (one of them "server"); the public keys of `authorized` are copied to
/// authorized/, the server's authorized_keys_dir.
struct CurveKeys {
  std::filesystem::path root;
  CurveKeys(const std::vector<std::string>& pairs, const std::vector<std::string>& authorized) {
    static int count = 0;
    root = std::filesystem::temp_directory_path() / fmt::format("bf-curve-test-{}-{}", ::getpid(), count++);
    std::filesystem::create_directories(root / "authorized");
    for (const auto& name : pairs) {
      auto pair = generate_curve_keypair();
      REQUIRE(pair.ok());
      REQUIRE(write_curve_keypair(root.string(), name, *pair).ok());
    }
    for (const auto& name : authorized) std::filesystem::copy_file(root / (name + ".key"), root / "authorized" / (name + ".key"));
  }
  ~CurveKeys() {
    test::remove_tree(root.string());
  }
  CurveKeys(const CurveKeys&) = delete;
  CurveKeys& operator=(const CurveKeys&) = delete;

  std::string file(const std::string& name) const { return (root / name).string(); }
  ServerSecurity server() const { return {file("server.key_secret"), (root / "authorized").string(), false}; }
  ClientSecurity client(const std::string& who) const { return {file(who + ".key_secret"), file("server.key")}; }
};

/// A server, a client the server knows ("alice") and one it does not ("mallory").
struct AliceKeys : CurveKeys {
  AliceKeys() : CurveKeys({"server", "alice", "mallory"}, {"alice"}) {}
};

}  // namespace blockflow::test
