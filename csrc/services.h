// What llama-server's server.cpp sets up beside the models, for the router to run in a
// process of its own (the router process loads no llama.cpp):
//
// - router_settings(): what the HTTP layer of llama-server does with its arguments
//   (CORS, API keys, which of tools, MCP servers and the CORS proxy are on), read by
//   llama.cpp's parser, as plain values;
// - Services: the server tools (/tools: built-in tools and MCP servers' tools) and the
//   CORS proxy (/cors-proxy), llama-server's own handlers; a feature that is off answers
//   llama-server's 403.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine.h"

namespace pyllmrouter {

// JSON: {"cors_origins", "cors_methods", "cors_headers", "cors_credentials", "api_keys",
// "tools", "mcp", "ui_mcp_proxy"} as llama.cpp's parser leaves them for these arguments.
std::string router_settings(const std::vector<std::string> & args);

struct ServicesCore;

class Services {
  public:
    // llama-server's arguments (the router's); starts the MCP servers they name (as
    // llama-server does at start), throws std::runtime_error if that fails.
    explicit Services(const std::vector<std::string> & args);
    ~Services();

    std::shared_ptr<EngineReply> handle(const std::string & method, const std::string & path,
                                        const std::map<std::string, std::string> & query,
                                        const std::map<std::string, std::string> & headers,
                                        const std::string & body, const std::string & query_string,
                                        std::shared_ptr<StopFlag> stop, const Files & files = {});
    // Ends the requests in flight and the MCP servers (idempotent).
    void close();

  private:
    std::mutex mutex_;  // core_ is swapped out by close(), from any thread
    std::shared_ptr<ServicesCore> core_;
};

}  // namespace pyllmrouter
