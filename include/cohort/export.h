// COHORT_API marks what libcohort.so exports. The library is compiled with hidden visibility
// (-fvisibility=hidden): a class or function of include/cohort/ without COHORT_API is not part of
// its ABI, and nothing of src/ is.
#pragma once

#define COHORT_API __attribute__((visibility("default")))

// COHORT_LOCAL marks what src/ defines inside a public class (its Impl): a nested class takes its
// exported parent's visibility, so without this its out-of-line members would be exported too.
#define COHORT_LOCAL __attribute__((visibility("hidden")))
