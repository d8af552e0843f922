// cohort's error policy.
//
// Library code throws one of the exceptions below and never aborts the process. The command line
// catches them at the top and prints the message as one line, with a non-zero exit status. A
// message names the thing that is wrong (a path, a flag, a rank) and, where there is one, the fix.
#pragma once

#include <cohort/export.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace cohort {

class COHORT_API Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The user asked for something that cannot be done: a bad flag value, an unknown model, a
// negative batch size. Exit status 2.
class COHORT_API InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Reading or writing a file failed, or its contents are not what they claim to be.
class COHORT_API IoError : public Error {
 public:
  using Error::Error;
};

// A peer did not answer in time or went away.
class COHORT_API CommError : public Error {
 public:
  using Error::Error;
};

class COHORT_API TimeoutError : public CommError {
 public:
  using CommError::CommError;
};

namespace detail {
template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
}  // namespace detail

}  // namespace cohort

// COHORT_CHECK(cond, Type, message parts...) throws Type(message) when cond is false.
#define COHORT_CHECK(cond, Type, ...)                      \
  do {                                                     \
    if (!(cond)) {                                         \
      throw Type(::cohort::detail::concat(__VA_ARGS__));   \
    }                                                      \
  } while (false)

// COHORT_CHECK_EQ(a, b, Type, context...) prints both operands when they differ.
#define COHORT_CHECK_EQ(a, b, Type, ...)                                                     \
  do {                                                                                       \
    const auto& cohort_a_ = (a);                                                             \
    const auto& cohort_b_ = (b);                                                             \
    if (!(cohort_a_ == cohort_b_)) {                                                         \
      throw Type(::cohort::detail::concat(__VA_ARGS__, " (", #a, " = ", cohort_a_, ", ", #b, \
                                          " = ", cohort_b_, ")"));                          \
    }                                                                                        \
  } while (false)
