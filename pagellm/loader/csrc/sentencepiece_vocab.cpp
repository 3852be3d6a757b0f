// A GGUF SentencePiece-style vocabulary (tokenizer.ggml.model "llama") tokenized as llama.cpp tokenizes it
// (llama-vocab.cpp: tokenizer_st_partition, llm_tokenizer_spm_session, the SPM branch of tokenize), and decoded
// as the `tokenizers` pipeline of loader/gguf_tokenizer.py decodes it.
//
// Why by hand: the file has scores, not merges, and `tokenizers` needs merges: every two-piece split of every
// piece (515k for Gemma 3's 262k pieces), which costs seconds to build and about a second and ~100 MB resident
// to load at every start. llama.cpp's algorithm needs only the pieces and their scores: this builds its table in
// milliseconds from the file's own string array. Plain C++ over ctypes (no torch): ctypes releases the GIL, so
// the server's text pool encodes on several threads at once.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <queue>
#include <string>
#include <string_view>
#include <vector>

namespace {

enum TokenType : int32_t { NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6 };
constexpr char ESCAPED_SPACE[] = "\xE2\x96\x81";  // U+2581, SentencePiece's space
constexpr char REPLACEMENT[] = "\xEF\xBF\xBD";    // U+FFFD

struct Vocab {
    std::string blob;               // every piece's text, back to back
    std::vector<int64_t> offsets;   // piece i is blob[offsets[i], offsets[i + 1])
    std::vector<float> scores;
    std::vector<int32_t> types;
    // text -> id by open addressing over the ids (linear probing, at most half full): ~2 MB for 262k pieces,
    // where a node-based map held ~15 MB of the server's idle memory. A repeated text maps to its last id, as in
    // llama.cpp
    std::vector<int32_t> slots;  // -1: empty
    size_t slot_mask = 0;
    std::vector<int32_t> partition_order;  // control, unknown and user-defined ids, longest text first
    std::vector<int32_t> byte_ids;  // 256 ids: "<0xXX>", else the byte itself as a piece, else -1
    int32_t unknown_id = -1;  // stands for a byte without a byte piece
    bool add_space_prefix = false;
    int64_t longest_chars = 1;

    std::string_view text(int32_t id) const {
        return std::string_view(blob.data() + offsets[id], offsets[id + 1] - offsets[id]);
    }
    int32_t find(std::string_view piece) const {
        for (size_t at = std::hash<std::string_view>{}(piece) & slot_mask;; at = (at + 1) & slot_mask) {
            int32_t id = slots[at];
            if (id < 0 || text(id) == piece) return id;
        }
    }
    void index_ids() {
        size_t n = offsets.size() - 1, size = 2;
        while (size < 2 * n) size <<= 1;
        slots.assign(size, -1);
        slot_mask = size - 1;
        for (int32_t id = 0; id < (int32_t) n; ++id) {
            std::string_view piece = text(id);
            size_t at = std::hash<std::string_view>{}(piece) & slot_mask;
            while (slots[at] >= 0 && text(slots[at]) != piece) at = (at + 1) & slot_mask;
            slots[at] = id;
        }
    }
};

// llama.cpp's unicode_len_utf8: a lead byte's sequence length (a stray continuation byte counts as one)
int utf8_len(unsigned char c) {
    static const int lengths[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lengths[c >> 4];
}

bool valid_utf8(const std::string & bytes) {
    size_t i = 0;
    while (i < bytes.size()) {
        unsigned char c = bytes[i];
        int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
        if (n == 0 || i + n > bytes.size()) return false;
        uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
        for (int k = 1; k < n; ++k) {
            unsigned char d = bytes[i + k];
            if ((d >> 6) != 0x2) return false;
            cp = (cp << 6) | (d & 0x3F);
        }
        static const uint32_t smallest[5] = {0, 0, 0x80, 0x800, 0x10000};  // overlong forms are invalid
        if (cp < smallest[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
        i += n;
    }
    return true;
}

struct Symbol {
    const char * text;
    int32_t n;  // bytes; 0 once merged into its left neighbour
    int32_t prev, next;
};

struct Bigram {
    int32_t left, right;
    float score;
    int32_t size;
    // the queue's top is the best score, the leftmost among equal scores (llama.cpp's llm_bigram_spm)
    bool operator<(const Bigram & other) const {
        return score < other.score || (score == other.score && left > other.left);
    }
};

// One raw-text fragment, already space-escaped: llm_tokenizer_spm_session::tokenize.
void merge_fragment(const Vocab & vocab, const std::string & text, std::vector<int32_t> & out) {
    std::vector<Symbol> symbols;
    for (size_t offs = 0; offs < text.size();) {
        int32_t n = (int32_t) std::min<size_t>(utf8_len(text[offs]), text.size() - offs);
        int32_t index = (int32_t) symbols.size();
        symbols.push_back({text.data() + offs, n, index - 1, offs + n == text.size() ? -1 : index + 1});
        offs += n;
    }
    std::priority_queue<Bigram> queue;
    auto try_add = [&](int32_t left, int32_t right) {
        if (left == -1 || right == -1) return;
        std::string_view joined(symbols[left].text, symbols[left].n + symbols[right].n);
        int32_t id = vocab.find(joined);
        if (id >= 0) queue.push({left, right, vocab.scores[id], (int32_t) joined.size()});
    };
    for (int32_t i = 1; i < (int32_t) symbols.size(); ++i) try_add(i - 1, i);
    while (!queue.empty()) {
        Bigram bigram = queue.top();
        queue.pop();
        Symbol & left = symbols[bigram.left];
        Symbol & right = symbols[bigram.right];
        if (left.n == 0 || right.n == 0 || left.n + right.n != bigram.size) continue;  // stale
        left.n += right.n;
        right.n = 0;
        left.next = right.next;
        if (right.next >= 0) symbols[right.next].prev = bigram.left;
        try_add(left.prev, bigram.left);
        try_add(bigram.left, left.next);
    }
    // every merged symbol is a piece; a single character that is not one becomes byte tokens. A byte with
    // neither a byte piece nor an unknown piece is left out, as the `tokenizers` form of this vocabulary
    // leaves it (llama.cpp fails there); a real SentencePiece vocabulary has all 256 byte pieces.
    bool unknown_last = false;  // consecutive unknowns are one, as the `tokenizers` form fuses them
    for (int32_t i = symbols.empty() ? -1 : 0; i != -1; i = symbols[i].next) {
        std::string_view piece(symbols[i].text, symbols[i].n);
        int32_t id = vocab.find(piece);
        if (id >= 0) {
            out.push_back(id);
            unknown_last = false;
            continue;
        }
        for (unsigned char byte : piece) {
            if (vocab.byte_ids[byte] >= 0) {
                out.push_back(vocab.byte_ids[byte]);
                unknown_last = false;
            } else if (vocab.unknown_id >= 0 && !unknown_last) {
                out.push_back(vocab.unknown_id);
                unknown_last = true;
            }
        }
    }
}

struct Fragment {
    int64_t offset, length;
    int32_t token;  // -1: raw text
};

// llama.cpp's tokenizer_st_partition: each special piece in turn (longest first) cuts every raw fragment at
// each of its occurrences. Control and unknown pieces only when parse_special; user-defined ones always.
std::vector<Fragment> partition(const Vocab & vocab, std::string_view text, bool parse_special) {
    std::vector<Fragment> fragments;
    if (!text.empty()) fragments.push_back({0, (int64_t) text.size(), -1});
    std::vector<Fragment> cut;
    for (int32_t id : vocab.partition_order) {
        if (!parse_special && vocab.types[id] != USER_DEFINED) continue;
        std::string_view piece = vocab.text(id);
        bool found = false;
        cut.clear();
        for (const Fragment & fragment : fragments) {
            if (fragment.token >= 0) {
                cut.push_back(fragment);
                continue;
            }
            int64_t pos = fragment.offset, end = fragment.offset + fragment.length;
            std::string_view region = text.substr(0, end);
            for (size_t match; (match = region.find(piece, pos)) != std::string_view::npos;) {
                found = true;
                if ((int64_t) match > pos) cut.push_back({pos, (int64_t) match - pos, -1});
                cut.push_back({(int64_t) match, (int64_t) piece.size(), id});
                pos = match + piece.size();
            }
            if (pos < end) cut.push_back({pos, end - pos, -1});
        }
        if (found) fragments.swap(cut);
    }
    return fragments;
}

}  // namespace

extern "C" {

// strings: the GGUF string array (n records of a little-endian uint64 length and that many bytes); scores and
// types: n each. Returns the vocabulary, freed by sentencepiece_free.
void * sentencepiece_new(const char * strings, int64_t n, const float * scores, const int32_t * types,
                         int32_t add_space_prefix) {
    Vocab * vocab = new Vocab();
    vocab->offsets.reserve(n + 1);
    const char * p = strings;
    for (int64_t i = 0; i < n; ++i) {
        uint64_t length;
        std::memcpy(&length, p, 8);
        vocab->offsets.push_back((int64_t) vocab->blob.size());
        vocab->blob.append(p + 8, length);
        p += 8 + length;
    }
    vocab->offsets.push_back((int64_t) vocab->blob.size());
    vocab->scores.assign(scores, scores + n);
    vocab->types.assign(types, types + n);
    vocab->index_ids();
    for (int32_t id = 0; id < n; ++id) {
        std::string_view piece = vocab->text(id);
        int64_t chars = 0;
        for (unsigned char c : piece) chars += (c >> 6) != 0x2;
        vocab->longest_chars = std::max(vocab->longest_chars, chars);
        if ((types[id] == CONTROL || types[id] == UNKNOWN || types[id] == USER_DEFINED) && !piece.empty())
            vocab->partition_order.push_back(id);
    }
    std::stable_sort(vocab->partition_order.begin(), vocab->partition_order.end(),
                     [&](int32_t a, int32_t b) { return vocab->text(a).size() > vocab->text(b).size(); });
    static const char hex[] = "0123456789ABCDEF";
    vocab->byte_ids.assign(256, -1);
    for (int b = 0; b < 256; ++b) {
        const char name[7] = {'<', '0', 'x', hex[b >> 4], hex[b & 15], '>', 0};
        const char single[1] = {(char) b};
        int32_t id = vocab->find(std::string_view(name, 6));
        vocab->byte_ids[b] = id >= 0 ? id : vocab->find(std::string_view(single, 1));
    }
    vocab->unknown_id = vocab->find("<unk>");  // as the `tokenizers` form's unk_token
    vocab->add_space_prefix = add_space_prefix != 0;
    return vocab;
}

void sentencepiece_free(void * vocab) { delete static_cast<Vocab *>(vocab); }

// The offset just past a GGUF string array of n records from data[pos] (size: the bytes readable at data), or -1
// when a record runs past them. Why here: the header reader's walk over a vocabulary is a Python loop per piece.
int64_t gguf_strings_end(const unsigned char * data, int64_t size, int64_t pos, int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
        uint64_t length;
        if (pos < 0 || size - pos < 8) return -1;
        std::memcpy(&length, data + pos, 8);
        if (length > (uint64_t) (size - pos - 8)) return -1;
        pos += 8 + (int64_t) length;
    }
    return pos;
}

// The ids of `text` (no BOS / EOS: the caller adds them) into out[0:cap]; returns how many there are (call
// again with a larger buffer when that exceeds cap). space_prefix_first: the first fragment may take the space prefix (the start of a text;
// a continuation does not).
int64_t sentencepiece_encode(const void * handle, const char * text, int64_t length, int32_t parse_special,
                             int32_t space_prefix_first, int32_t * out, int64_t cap) {
    const Vocab & vocab = *static_cast<const Vocab *>(handle);
    std::string_view whole(text, length);
    std::vector<int32_t> ids;
    bool previous_special = space_prefix_first != 0;  // llama.cpp's is_prev_special: the first fragment counts
    std::string escaped;
    for (const Fragment & fragment : partition(vocab, whole, parse_special != 0)) {
        if (fragment.token >= 0) {
            ids.push_back(fragment.token);
            previous_special = true;
            continue;
        }
        escaped.clear();
        if (vocab.add_space_prefix && previous_special) escaped += ESCAPED_SPACE;
        for (char c : whole.substr(fragment.offset, fragment.length)) {
            if (c == ' ') escaped += ESCAPED_SPACE;
            else escaped += c;
        }
        merge_fragment(vocab, escaped, ids);
        previous_special = false;
    }
    std::copy_n(ids.begin(), std::min<int64_t>(cap, (int64_t) ids.size()), out);
    return (int64_t) ids.size();
}

// The UTF-8 text of ids into out[0:cap]; returns its length (call again with a larger buffer when that exceeds
// cap). As the tokenizers decoders Replace("▁", " "), ByteFallback, Fuse and, with the space prefix, Strip one
// leading space: a run of byte pieces that is not valid UTF-8 gives one U+FFFD per byte; ids outside the
// vocabulary are skipped, and control / unknown pieces when skip_special.
int64_t sentencepiece_decode(const void * handle, const int32_t * ids, int64_t n, int32_t skip_special, char * out,
                             int64_t cap) {
    const Vocab & vocab = *static_cast<const Vocab *>(handle);
    std::string text, bytes;
    auto flush_bytes = [&]() {
        if (bytes.empty()) return;
        if (valid_utf8(bytes)) text += bytes;
        else for (size_t k = 0; k < bytes.size(); ++k) text += REPLACEMENT;
        bytes.clear();
    };
    for (int64_t i = 0; i < n; ++i) {
        int32_t id = ids[i];
        if (id < 0 || id >= (int64_t) vocab.types.size()) continue;
        if (skip_special && (vocab.types[id] == CONTROL || vocab.types[id] == UNKNOWN)) continue;
        std::string_view piece = vocab.text(id);
        auto hex = [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); };
        if (piece.size() == 6 && piece.substr(0, 3) == "<0x" && piece[5] == '>' && hex(piece[3]) && hex(piece[4])) {
            bytes += (char) std::stoi(std::string(piece.substr(3, 2)), nullptr, 16);
            continue;
        }
        flush_bytes();
        for (size_t k = 0; k < piece.size();) {
            if (piece.compare(k, 3, ESCAPED_SPACE) == 0) {
                text += ' ';
                k += 3;
            } else {
                text += piece[k++];
            }
        }
    }
    flush_bytes();
    size_t start = vocab.add_space_prefix && !text.empty() && text[0] == ' ' ? 1 : 0;
    int64_t size = (int64_t) (text.size() - start);
    std::memcpy(out, text.data() + start, std::min<int64_t>(cap, size));
    return size;
}

// The id of a piece's text, or -1.
int32_t sentencepiece_token_id(const void * handle, const char * text, int64_t length) {
    return static_cast<const Vocab *>(handle)->find(std::string_view(text, length));
}

// A piece's text (not NUL-terminated) and its length through `length`.
const char * sentencepiece_token_text(const void * handle, int32_t id, int64_t * length) {
    std::string_view piece = static_cast<const Vocab *>(handle)->text(id);
    *length = (int64_t) piece.size();
    return piece.data();
}

// The most characters one piece has.
int64_t sentencepiece_longest_piece(const void * handle) {
    return static_cast<const Vocab *>(handle)->longest_chars;
}

}  // extern "C"
