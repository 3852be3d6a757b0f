// Per-thread scratch a kernel keeps between calls, and the entry that gives it back.
//
// A kernel's scratch (quantized activation rows, a product before its epilogue) lives in a thread_local vector so
// that a warm step allocates nothing. It grows to the largest step the thread has run, though, and the heap cannot
// hand those pages back while a vector still holds them: after a burst of long prefills an idle server would keep
// them resident for good. So every vector is reached through scratch<Tag, T>(), which registers it with its
// thread on first use, and pagellm_release_thread_scratch() empties every registered vector on every thread of the
// calling thread's OpenMP team (the threads the kernels ran on); the engine calls it when it idles, before
// malloc_trim. Each library that includes this header exports its own copy: its scratch is its own.
#pragma once

#include <vector>

#include <omp.h>

namespace thread_scratch {

using Release = void (*)();

// The calling thread's registered vectors, as functions that empty one each.
inline std::vector<Release>& releases() {
    thread_local std::vector<Release> list;
    return list;
}

// The calling thread's vector for (Tag, T): a Tag per buffer, so two buffers of one type stay apart.
template <class Tag, class T>
std::vector<T>& scratch() {
    thread_local std::vector<T> buffer;
    thread_local bool registered = false;
    if (!registered) {
        releases().push_back([] { std::vector<T>().swap(scratch<Tag, T>()); });  // swap: clear() keeps capacity
        registered = true;
    }
    return buffer;
}

}  // namespace thread_scratch

// Every thread of the calling thread's team empties its scratch (the team is as wide as the kernels' widest).
extern "C" void pagellm_release_thread_scratch() {
#pragma omp parallel
    {
        for (thread_scratch::Release release : thread_scratch::releases()) release();
    }
}
