// COHORT_API marks what libcohort.so exports. The library is compiled with hidden visibility
// (-fvisibility=hidden): a class or function of include/cohort/ without COHORT_API is not part of
// its ABI, and nothing of src/ is.
#pragma once

#define COHORT_API __attribute__((visibility("default")))
