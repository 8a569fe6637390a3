#pragma once
// Internal: the hand-over from the blockflow-worker launcher to the worker runtime.
//
// The launcher links neither libtorch nor BlockFlow: it says hello, waits for its configuration
// (so an idle worker costs a few MB), then dlopen()s the runtime module
// (libblockflow_worker_runtime.so) and calls blockflow_worker_serve() with the connected control
// socket and the configuration. Plain C types: the two sides share only libzmq.

extern "C" {

struct BlockflowWorkerLaunch {
  const char* name;
  const char* control;      // endpoint the control socket is connected to
  const char* requests;     // data endpoints (filled from the config for a joined worker)
  const char* results;
  long parent;              // the host's pid, 0 for a worker that joined over TCP
  int join;                 // 1: joined over TCP (host liveness from its pings)
  void* control_socket;     // a connected ZeroMQ DEALER that already said hello
  const char* config_json;  // the configuration the host sent
  int stopped_by_host;      // out: 1 when the host sent stop
  // A joined worker loads only what its own command line allows (the configuration comes from
  // whoever answers at the join address): these plugins (--plugin, canonical paths) and TorchScript
  // files inside this directory (--models, canonical; null: none). Ignored for a child worker.
  const char* const* allowed_plugins;
  int allowed_plugin_count;
  const char* models_dir;
  // A joined worker that talks CURVE (--key, --session-key): its key pair and the session's public
  // key files, for the data sockets (the control socket is already secured). Null: plain TCP.
  const char* curve_secret_key_file;
  const char* curve_server_key_file;
};

// Serves until the host stops it or goes away; 0 on a clean stop.
typedef int (*BlockflowWorkerServeFn)(BlockflowWorkerLaunch* launch);
}
