# llama_engine: llama.cpp's common library and server-context, as llama-server
# builds them (tools/server/CMakeLists.txt, common/CMakeLists.txt), from the
# pinned source tree LLAMA_SRC; a static, position-independent archive that
# links the installed shared libllama, libggml and libmtmd.
set(LS "${LLAMA_SRC}")
find_package(Threads REQUIRED)
include("${LS}/common/parsers/sources.cmake")

set(LLAMA_BUILD_NUMBER 0)
file(READ "${CMAKE_CURRENT_SOURCE_DIR}/vendor/pin.json" PIN_JSON)
string(JSON LLAMA_BUILD_COMMIT GET "${PIN_JSON}" llama_cpp_commit)
set(BUILD_COMPILER "${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}")
set(BUILD_TARGET "${CMAKE_SYSTEM_PROCESSOR}")
configure_file("${LS}/common/build-info.cpp.in" "${CMAKE_CURRENT_BINARY_DIR}/build-info.cpp")

set(COMMON_SOURCES
  arg.cpp chat-auto-parser-generator.cpp chat-auto-parser-helpers.cpp chat-diff-analyzer.cpp
  chat-peg-parser.cpp chat.cpp common.cpp console.cpp debug.cpp download.cpp fit.cpp hf-cache.cpp
  imatrix-loader.cpp json-schema-to-grammar.cpp json-schema.cpp json.cpp llguidance.cpp log.cpp
  ngram-cache.cpp ngram-map.cpp ngram-mod.cpp peg-parser.cpp preset.cpp reasoning-budget.cpp
  sampling.cpp speculative.cpp subproc.cpp trie.cpp unicode.cpp
  jinja/lexer.cpp jinja/parser.cpp jinja/runtime.cpp jinja/value.cpp jinja/string.cpp jinja/caps.cpp)
list(TRANSFORM COMMON_SOURCES PREPEND "${LS}/common/")
set(SERVER_SOURCES
  server-chat.cpp server-task.cpp server-common.cpp server-context.cpp
  server-stream.cpp server-tools.cpp server-mcp.cpp server-schema.cpp server-models.cpp)
list(TRANSFORM SERVER_SOURCES PREPEND "${LS}/tools/server/")

# Two changes to llama.cpp's engine.  The first: a request whose caller has gone stops within
# 50 ms.  A handler waiting for its results looks at its should_stop only when its wait for a
# result times out, after a whole second (HTTP_POLLING_SECONDS), and every other request's
# result restarts that second: under load a stopped request was never looked at and ran to its
# end.  Here the wait ends 50 ms after it began, whatever wakes it meanwhile (a deadline, not
# a restarted timeout); its callers (the response reader, the router's SSE client) then look
# at should_stop and wait again, as they do after a timeout.  The build fails if the pinned
# source no longer reads as expected.
set(QUEUE_SRC "${LS}/tools/server/server-queue.cpp")
file(READ "${QUEUE_SRC}" QUEUE_TEXT)
set(QUEUE_ENTRY "server_task_result_ptr server_response::recv_with_timeout(const std::unordered_set<int> & id_tasks, int timeout) {\n")
set(QUEUE_WAIT "condition_results.wait_for(lock, std::chrono::seconds(timeout));")
string(FIND "${QUEUE_TEXT}" "${QUEUE_ENTRY}" AT_ENTRY)
string(FIND "${QUEUE_TEXT}" "${QUEUE_WAIT}" AT_WAIT)
if(AT_ENTRY EQUAL -1 OR AT_WAIT EQUAL -1)
  message(FATAL_ERROR "pyllmrouter: ${QUEUE_SRC} no longer has the wait cmake/llama_engine.cmake changes")
endif()
string(REPLACE "${QUEUE_ENTRY}" "${QUEUE_ENTRY}    // pyllmrouter (cmake/llama_engine.cmake): ends 50 ms after it began, whatever wakes it\n    const auto stop_check_at = std::chrono::steady_clock::now() +\n        std::min<std::chrono::steady_clock::duration>(std::chrono::milliseconds(50), std::chrono::seconds(timeout));\n" QUEUE_TEXT "${QUEUE_TEXT}")
string(REPLACE "${QUEUE_WAIT}" "condition_results.wait_until(lock, stop_check_at);" QUEUE_TEXT "${QUEUE_TEXT}")
# The second: a slot that frees puts back every deferred task, not one.  llama.cpp puts back one
# (one for that slot first: a slot save, restore or erase), and a slot action frees no slot
# when it ends, so a completion deferred behind it waited until some other task ended (for
# ever, where none came): with one slot, a completion, a save of the slot and a second
# completion left the second waiting (tests/native/test_engine_queue.py).  Every task goes back, in
# its order, behind the one chosen; those whose slot is still busy are deferred again.
set(DEFER_END "            queue_tasks_deferred.pop_front();\n        }\n    }\n    time_last_task = ggml_time_ms();")
string(FIND "${QUEUE_TEXT}" "${DEFER_END}" AT_DEFER)
if(AT_DEFER EQUAL -1)
  message(FATAL_ERROR "pyllmrouter: ${QUEUE_SRC} no longer has the pop_deferred_task cmake/llama_engine.cmake changes")
endif()
string(REPLACE "${DEFER_END}" "            queue_tasks_deferred.pop_front();\n        }\n        // pyllmrouter (cmake/llama_engine.cmake): the other deferred tasks go back too, in order\n        for (auto it = queue_tasks_deferred.rbegin(); it != queue_tasks_deferred.rend(); ++it) {\n            queue_tasks.insert(queue_tasks.begin() + 1, std::move(*it));\n        }\n        queue_tasks_deferred.clear();\n    }\n    time_last_task = ggml_time_ms();" QUEUE_TEXT "${QUEUE_TEXT}")
set(QUEUE_PATCHED "${CMAKE_CURRENT_BINARY_DIR}/engine-src/server-queue.cpp")
file(WRITE "${QUEUE_PATCHED}.new" "${QUEUE_TEXT}")
configure_file("${QUEUE_PATCHED}.new" "${QUEUE_PATCHED}" COPYONLY)  # rewritten only when it changes
list(APPEND SERVER_SOURCES "${QUEUE_PATCHED}")
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${QUEUE_SRC}")

add_library(llama_engine STATIC
  ${COMMON_SOURCES} ${LLAMA_CHAT_PARSERS_SOURCES} ${SERVER_SOURCES}
  "${CMAKE_CURRENT_BINARY_DIR}/build-info.cpp"
  "${LS}/vendor/cpp-httplib/httplib.cpp")
set_target_properties(llama_engine PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(llama_engine PUBLIC
  "${LS}/common" "${LS}/tools/server" "${LS}/tools/mtmd" "${LS}/vendor" "${LS}")
# as vendor/cpp-httplib/CMakeLists.txt builds it
set_source_files_properties("${LS}/vendor/cpp-httplib/httplib.cpp" PROPERTIES
  COMPILE_OPTIONS "-w"
  COMPILE_DEFINITIONS "CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH=1048576;CPPHTTPLIB_LISTEN_BACKLOG=512;CPPHTTPLIB_REQUEST_URI_MAX_LENGTH=32768;CPPHTTPLIB_TCP_NODELAY=1")
target_compile_features(llama_engine PUBLIC cxx_std_17)
# llama.cpp's default everywhere but mobile and WASM (its CMakeLists.txt, LLAMA_SUBPROCESS):
# the server tools and MCP servers spawn processes
target_compile_definitions(llama_engine PUBLIC LLAMA_SUBPROCESS)
target_link_libraries(llama_engine PUBLIC llama ggml::ggml "${MTMD_LIBRARY}" Threads::Threads)
