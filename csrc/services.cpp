// llama-server's services beside the models: see services.h.
#include "services.h"

#include <stdexcept>

#include "common.h"
#include "params.h"
#include "server-common.h"
#include "server-models.h"  // server_http_proxy, which the CORS proxy uses
#include "server-cors-proxy.h"
#include "server-http.h"
#include "server-mcp.h"
#include "server-tools.h"

namespace pyllmrouter {

std::string router_settings(const std::vector<std::string> & args) {
    const common_params p = parse_server_args(args, nullptr, /*resolve_ctx=*/false);
    const bool mcp_on = !p.mcp_servers_config.empty() || !p.mcp_servers_json.empty();
    return safe_json_to_str({
        {"cors_origins", p.cors_origins},
        {"cors_origins_explicit", p.cors_origins_explicit},
        {"cors_methods", p.cors_methods},
        {"cors_headers", p.cors_headers},
        {"cors_credentials", p.cors_credentials},
        {"api_keys", p.api_keys},
        {"tools", !p.server_tools.empty() || mcp_on},
        {"mcp", mcp_on},
        {"ui_mcp_proxy", p.ui_mcp_proxy},
        {"timeout_write", p.timeout_write},
    });
}

struct ServicesCore : ReplyOwner {
    explicit ServicesCore(common_params p) : params(std::move(p)) {}
    common_params params;
    server_mcp mcp;
    server_tools tools;
    std::map<std::string, Handler> routes;
};

namespace {

// server.cpp's res_403: a feature llama-server was not started with
std::unique_ptr<server_http_res> disabled(const server_http_req &) {
    auto res = std::make_unique<server_http_res>();
    res->status = 403;
    res->data = safe_json_to_str({{"error", {{"message", "this feature is disabled"}, {"type", "feature_disabled"}}}});
    return res;
}

}  // namespace

Services::Services(const std::vector<std::string> & args)
    : core_(std::make_shared<ServicesCore>(parse_server_args(args, nullptr, /*resolve_ctx=*/false))) {
    ServicesCore & c = *core_;
    // as server.cpp, in its order: the CORS proxy, the MCP servers, then the tools
    if (c.params.ui_mcp_proxy) {
        c.routes["GET /cors-proxy"] = proxy_handler_get;
        c.routes["POST /cors-proxy"] = proxy_handler_post;
    } else {
        c.routes["GET /cors-proxy"] = c.routes["POST /cors-proxy"] = disabled;
    }
    c.mcp.start(c.params);
    if (!c.params.server_tools.empty() || !c.mcp.empty()) {
        c.tools.setup(c.params.server_tools, c.mcp, c.params.server_tools_runtime);
        c.routes["GET /tools"] = c.tools.handle_get;
        c.routes["POST /tools"] = c.tools.handle_post;
    } else {
        c.routes["GET /tools"] = c.routes["POST /tools"] = disabled;
    }
}

Services::~Services() { close(); }

std::shared_ptr<EngineReply> Services::handle(const std::string & method, const std::string & path,
                                              const std::map<std::string, std::string> & query,
                                              const std::map<std::string, std::string> & headers,
                                              const std::string & body, const std::string & query_string,
                                              std::shared_ptr<StopFlag> stop, const Files & files) {
    std::shared_ptr<ServicesCore> core;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        core = core_;
    }
    auto reply = std::make_shared<EngineReply>(core, query, headers, path, query_string, body, std::move(stop),
                                                files);
    if (!core || core->closing.load()) {
        reply->fail("the services are closing", "unavailable");
        return reply;
    }
    const auto it = core->routes.find(method + " " + path);
    reply->respond(it != core->routes.end() ? it->second : Handler());
    return reply;
}

void Services::close() {
    std::shared_ptr<ServicesCore> core;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        core.swap(core_);
    }
    if (!core) return;
    core->closing.store(true);
    core->mcp.shutdown();
}

}  // namespace pyllmrouter
