#pragma once
// Errors that reach the user. Every message names the file, tensor or field at fault.
#include <fmt/format.h>
#include <stdexcept>
#include <string>

namespace quads {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace quads

// QUADS_CHECK(cond, "fmt {}", args...): throws quads::Error with the formatted message.
#define QUADS_CHECK(cond, ...)                 \
  do {                                         \
    if (!(cond)) ::quads::fail(__VA_ARGS__);   \
  } while (0)
