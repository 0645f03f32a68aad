/* kvcm.core._lookup_index: the lookup's cross-pool key index in compiled code.
 *
 * KeyIndex maps a cache key (bytes) to the set of pool slots caching it, and walks a prompt's
 * blocks over it. The pure-Python kvcm.core._key_index.PyKeyIndex gives identical answers;
 * kvcm.core.lookup uses this one when it is built (docs/lookup.md says why it exists).
 *
 * Table: open addressing, linear probing, power-of-two capacity, backward-shift deletion (no
 * tombstones), at most 5/8 full. An entry holds the key's hash (CPython's hash of the bytes,
 * the keyed SipHash every dict uses, cached in the key object), a strong reference to the key
 * (compared with memcmp: exact), and the key's pool set: sorted uint16 slots, up to 4 inline,
 * more in a heap array. Adding or removing one slot of one key is a probe and a small
 * insertion: O(1) for the usual handful of holders, O(holders) at worst.
 *
 * Every method runs holding the GIL and never calls back into Python code while it changes
 * the table (keys must be bytes), so each call is atomic for other Python threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <structmember.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#define INLINE_IDS 4
#define MAX_SLOT 65534
#define MIN_CAPACITY 64
#define PREFETCH_AHEAD 16
#define MAX_KEY 256

typedef struct {
    Py_hash_t hash;
    PyObject *key; /* NULL: empty */
    uint32_t n;    /* slots in the set */
    uint32_t cap;  /* 0: inline */
    union {
        uint16_t inl[INLINE_IDS];
        uint16_t *heap;
    } ids;
} Entry;

typedef struct {
    PyObject_HEAD
    Entry *table;
    size_t mask; /* capacity - 1 */
    size_t used;
    int mapped; /* the table is an mmap of its own (large tables, on Linux) */
} KeyIndex;

/* Tables from this size get pages of their own, advised to be huge pages: a walk's probes
   land anywhere in hundreds of MB, and 4 KiB pages would add a TLB miss to most of them. */
#define MAPPED_BYTES ((size_t)4 << 20)

static Entry *table_alloc(size_t capacity, int *mapped) {
    size_t bytes = capacity * sizeof(Entry);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    if (bytes >= MAPPED_BYTES) {
        void *table = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (table != MAP_FAILED) {
            (void)madvise(table, bytes, MADV_HUGEPAGE); /* a hint: refused, 4 KiB pages */
            *mapped = 1;
            return table; /* zero-filled */
        }
    }
#endif
    *mapped = 0;
    return PyMem_Calloc(capacity, sizeof(Entry));
}

static void table_free(Entry *table, size_t capacity, int mapped) {
    if (table == NULL) {
        return;
    }
#ifdef __linux__
    if (mapped) {
        munmap(table, capacity * sizeof(Entry));
        return;
    }
#else
    (void)capacity;
    (void)mapped;
#endif
    PyMem_Free(table);
}

static inline const uint16_t *entry_ids(const Entry *e) {
    return e->cap ? e->ids.heap : e->ids.inl;
}

static inline uint16_t *entry_ids_mut(Entry *e) { return e->cap ? e->ids.heap : e->ids.inl; }

static Py_hash_t hash_buffer(const void *data, Py_ssize_t size) {
#if PY_VERSION_HEX >= 0x030E0000
    return Py_HashBuffer(data, size);
#else
    return _Py_HashBytes(data, size);
#endif
}

/* The entry of a key, or the empty entry where it would go. */
static inline Entry *probe(const KeyIndex *self, Py_hash_t hash, const char *data,
                           Py_ssize_t size) {
    size_t i = (size_t)hash & self->mask;
    for (;;) {
        Entry *e = &self->table[i];
        if (e->key == NULL) {
            return e;
        }
        if (e->hash == hash && PyBytes_GET_SIZE(e->key) == size &&
            memcmp(PyBytes_AS_STRING(e->key), data, (size_t)size) == 0) {
            return e;
        }
        i = (i + 1) & self->mask;
    }
}

static int resize(KeyIndex *self, size_t capacity) {
    int mapped;
    Entry *table = table_alloc(capacity, &mapped);
    if (table == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Entry *old = self->table;
    size_t old_capacity = old == NULL ? 0 : self->mask + 1;
    size_t mask = capacity - 1;
    for (size_t j = 0; j < old_capacity; j++) {
        if (old[j].key != NULL) {
            size_t i = (size_t)old[j].hash & mask;
            while (table[i].key != NULL) {
                i = (i + 1) & mask;
            }
            table[i] = old[j];
        }
    }
    table_free(old, old_capacity, self->mapped);
    self->table = table;
    self->mask = mask;
    self->mapped = mapped;
    return 0;
}

/* Remove the entry at position i (its key released, its heap set freed by the caller). */
static void delete_at(KeyIndex *self, size_t i) {
    size_t mask = self->mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        Entry *e = &self->table[j];
        if (e->key == NULL) {
            break;
        }
        size_t home = (size_t)e->hash & mask;
        /* e may fill the hole at i unless its home lies cyclically in (i, j]. */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            self->table[i] = *e;
            i = j;
        }
    }
    memset(&self->table[i], 0, sizeof(Entry));
    self->used--;
}

static int set_add(Entry *e, uint16_t slot) {
    uint16_t *ids = entry_ids_mut(e);
    uint32_t lo = 0, hi = e->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (ids[mid] < slot) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (lo < e->n && ids[lo] == slot) {
        return 0;
    }
    uint32_t room = e->cap ? e->cap : INLINE_IDS;
    if (e->n == room) {
        uint32_t cap = room * 2;
        uint16_t *heap = PyMem_Malloc(cap * sizeof(uint16_t));
        if (heap == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(heap, ids, e->n * sizeof(uint16_t));
        if (e->cap) {
            PyMem_Free(e->ids.heap);
        }
        e->ids.heap = heap;
        e->cap = cap;
        ids = heap;
    }
    memmove(ids + lo + 1, ids + lo, (e->n - lo) * sizeof(uint16_t));
    ids[lo] = slot;
    e->n++;
    return 0;
}

static void set_discard(Entry *e, uint16_t slot) {
    uint16_t *ids = entry_ids_mut(e);
    uint32_t lo = 0, hi = e->n;
    while (lo < hi) {
        uint32_t mid = (lo + hi) / 2;
        if (ids[mid] < slot) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    if (lo == e->n || ids[lo] != slot) {
        return;
    }
    memmove(ids + lo, ids + lo + 1, (e->n - lo - 1) * sizeof(uint16_t));
    e->n--;
    if (e->cap && e->n <= INLINE_IDS) {
        uint16_t *heap = e->ids.heap;
        uint16_t copy[INLINE_IDS];
        memcpy(copy, heap, e->n * sizeof(uint16_t));
        PyMem_Free(heap);
        e->cap = 0;
        memcpy(e->ids.inl, copy, e->n * sizeof(uint16_t));
    }
}

static int parse_slot(PyObject *arg, uint16_t *slot) {
    long value = PyLong_AsLong(arg);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (value < 0 || value > MAX_SLOT) {
        PyErr_Format(PyExc_ValueError, "slot must be in [0, %d], got %ld", MAX_SLOT, value);
        return -1;
    }
    *slot = (uint16_t)value;
    return 0;
}

/* ------------------------------------------------------------------------------ methods */

static PyObject *KeyIndex_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyIndex() takes no arguments");
        return NULL;
    }
    KeyIndex *self = (KeyIndex *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    if (resize(self, MIN_CAPACITY) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void KeyIndex_dealloc(KeyIndex *self) {
    if (self->table != NULL) {
        for (size_t j = 0; j <= self->mask; j++) {
            Entry *e = &self->table[j];
            if (e->key != NULL) {
                Py_DECREF(e->key);
                if (e->cap) {
                    PyMem_Free(e->ids.heap);
                }
            }
        }
        table_free(self->table, self->mask + 1, self->mapped);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static Py_ssize_t KeyIndex_len(KeyIndex *self) { return (Py_ssize_t)self->used; }

static int check_key(PyObject *key) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "keys must be bytes, got %.100s", Py_TYPE(key)->tp_name);
        return -1;
    }
    return 0;
}

/* The keys of add/discard as a sequence (a list or tuple as given, else a new list), every
   one checked to be bytes before anything changes; their hashes (cached in the key objects)
   go in *hashes (a new array the caller frees). NULL with an exception set on error. */
static PyObject *checked_keys(PyObject *keys, Py_hash_t **hashes) {
    PyObject *seq = PySequence_Fast(keys, "keys must be iterable");
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    *hashes = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Py_hash_t));
    if (*hashes == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) {
            __builtin_prefetch(items[i + PREFETCH_AHEAD]); /* the key's header: its hash */
        }
        Py_hash_t hash = -1;
        if (check_key(items[i]) == 0) {
            hash = PyObject_Hash(items[i]);
        }
        if (hash == -1) {
            PyMem_Free(*hashes);
            *hashes = NULL;
            Py_DECREF(seq);
            return NULL;
        }
        (*hashes)[i] = hash;
    }
    return seq;
}

/* Keys are applied in order, the table entry of the key PREFETCH_AHEAD places on requested
   ahead (an eviction's or a cache call's keys land anywhere in a table of millions). */
static inline void prefetch_entry(const KeyIndex *self, const Py_hash_t *hashes, Py_ssize_t i,
                                  Py_ssize_t n) {
    if (i + PREFETCH_AHEAD < n) {
        __builtin_prefetch(&self->table[(size_t)hashes[i + PREFETCH_AHEAD] & self->mask]);
    }
}

/* The entry of a key, or the empty entry where it would go; a stored key that is the same
   object matches without reading its bytes. */
static inline Entry *probe_key(const KeyIndex *self, Py_hash_t hash, PyObject *key) {
    size_t i = (size_t)hash & self->mask;
    Py_ssize_t size = PyBytes_GET_SIZE(key);
    const char *data = PyBytes_AS_STRING(key);
    for (;;) {
        Entry *e = &self->table[i];
        if (e->key == NULL || e->key == key) {
            return e;
        }
        if (e->hash == hash && PyBytes_GET_SIZE(e->key) == size &&
            memcmp(PyBytes_AS_STRING(e->key), data, (size_t)size) == 0) {
            return e;
        }
        i = (i + 1) & self->mask;
    }
}

static PyObject *KeyIndex_add(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    uint16_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add(keys, slot) takes 2 arguments");
        return NULL;
    }
    if (parse_slot(args[1], &slot) < 0) {
        return NULL;
    }
    Py_hash_t *hashes;
    PyObject *seq = checked_keys(args[0], &hashes);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    /* Room for every key first (the table moves only here, so the prefetches stay valid). */
    size_t capacity = self->mask + 1;
    while ((self->used + (size_t)n) * 8 > capacity * 5) {
        capacity *= 2;
    }
    if (capacity != self->mask + 1 && resize(self, capacity) < 0) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        __builtin_prefetch(&self->table[(size_t)hashes[i] & self->mask]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_entry(self, hashes, i, n);
        PyObject *key = items[i];
        Entry *e = probe_key(self, hashes[i], key);
        if (e->key == NULL) {
            Py_INCREF(key);
            e->hash = hashes[i];
            e->key = key;
            e->n = 1;
            e->cap = 0;
            e->ids.inl[0] = slot;
            self->used++;
        } else if (set_add(e, slot) < 0) {
            goto fail;
        }
    }
    PyMem_Free(hashes);
    Py_DECREF(seq);
    Py_RETURN_NONE;
fail:
    PyMem_Free(hashes);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *KeyIndex_discard(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    uint16_t slot;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "discard(keys, slot) takes 2 arguments");
        return NULL;
    }
    if (parse_slot(args[1], &slot) < 0) {
        return NULL;
    }
    Py_hash_t *hashes;
    PyObject *seq = checked_keys(args[0], &hashes);
    if (seq == NULL) {
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) {
        __builtin_prefetch(&self->table[(size_t)hashes[i] & self->mask]);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_entry(self, hashes, i, n);
        Entry *e = probe_key(self, hashes[i], items[i]);
        if (e->key == NULL) {
            continue;
        }
        set_discard(e, slot);
        if (e->n == 0) {
            PyObject *stored = e->key;
            if (e->cap) {
                PyMem_Free(e->ids.heap);
            }
            delete_at(self, (size_t)(e - self->table));
            Py_DECREF(stored); /* bytes: no code runs */
        }
    }
    PyMem_Free(hashes);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* A Python int of the set bits of slots (sorted, distinct). */
static PyObject *mask_of_ids(const uint16_t *ids, uint32_t n) {
    if (n == 0) {
        return PyLong_FromLong(0);
    }
    size_t nbytes = (size_t)ids[n - 1] / 8 + 1;
    unsigned char *bytes = PyMem_Calloc(nbytes, 1);
    if (bytes == NULL) {
        return PyErr_NoMemory();
    }
    for (uint32_t k = 0; k < n; k++) {
        bytes[ids[k] >> 3] |= (unsigned char)(1u << (ids[k] & 7));
    }
    PyObject *mask = _PyLong_FromByteArray(bytes, nbytes, 1, 0);
    PyMem_Free(bytes);
    return mask;
}

static PyObject *KeyIndex_get(KeyIndex *self, PyObject *key) {
    if (check_key(key) < 0) {
        return NULL;
    }
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1) {
        return NULL;
    }
    Entry *e = probe(self, hash, PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key));
    if (e->key == NULL) {
        return PyLong_FromLong(0);
    }
    return mask_of_ids(entry_ids(e), e->n);
}

/* A bitset over slots, as uint64 words, from a non-negative Python int. */
static uint64_t *bits_of_int(PyObject *mask, size_t *nwords) {
    if (!PyLong_Check(mask)) {
        PyErr_SetString(PyExc_TypeError, "scope must be an int");
        return NULL;
    }
    if (Py_SIZE(mask) < 0) {
        PyErr_SetString(PyExc_ValueError, "scope must be >= 0");
        return NULL;
    }
    size_t nbits = _PyLong_NumBits(mask);
    if (nbits == (size_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (nbits > MAX_SLOT + 1) {
        PyErr_SetString(PyExc_ValueError, "scope has a slot above the largest");
        return NULL;
    }
    size_t words = (nbits + 63) / 64;
    if (words == 0) {
        words = 1;
    }
    uint64_t *bits = PyMem_Calloc(words, sizeof(uint64_t));
    if (bits == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    PyObject *raw = PyObject_CallMethod(mask, "to_bytes", "ns", (Py_ssize_t)(words * 8), "little");
    if (raw == NULL) {
        PyMem_Free(bits);
        return NULL;
    }
    const unsigned char *data = (const unsigned char *)PyBytes_AS_STRING(raw);
    for (size_t w = 0; w < words; w++) {
        uint64_t word = 0;
        for (int b = 7; b >= 0; b--) {
            word = (word << 8) | data[w * 8 + (size_t)b];
        }
        bits[w] = word;
    }
    Py_DECREF(raw);
    *nwords = words;
    return bits;
}

static PyObject *int_of_bits(const uint64_t *bits, size_t words) {
    unsigned char *bytes = PyMem_Malloc(words * 8);
    if (bytes == NULL) {
        return PyErr_NoMemory();
    }
    for (size_t w = 0; w < words; w++) {
        for (int b = 0; b < 8; b++) {
            bytes[w * 8 + (size_t)b] = (unsigned char)(bits[w] >> (8 * b));
        }
    }
    PyObject *mask = _PyLong_FromByteArray(bytes, words * 8, 1, 0);
    PyMem_Free(bytes);
    return mask;
}

static int append_level(PyObject *levels, Py_ssize_t depth, const uint64_t *bits, size_t words) {
    PyObject *mask = int_of_bits(bits, words);
    if (mask == NULL) {
        return -1;
    }
    PyObject *level = Py_BuildValue("(nN)", depth, mask);
    if (level == NULL) {
        return -1;
    }
    int failed = PyList_Append(levels, level);
    Py_DECREF(level);
    return failed;
}

/* Make block b's key (its hash then the suffix) in key, hash it into ahead[b % PREFETCH_AHEAD]
   and prefetch its table entry. */
static inline void make_key(const KeyIndex *self, char *key, Py_hash_t *ahead, Py_ssize_t b,
                            const char *raw, Py_ssize_t hash_size, const char *suffix,
                            Py_ssize_t suffix_size) {
    memcpy(key, raw + b * hash_size, (size_t)hash_size);
    memcpy(key + hash_size, suffix, (size_t)suffix_size);
    Py_hash_t hash = hash_buffer(key, hash_size + suffix_size);
    ahead[b % PREFETCH_AHEAD] = hash;
    __builtin_prefetch(&self->table[(size_t)hash & self->mask]);
}

static PyObject *KeyIndex_walk(KeyIndex *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "walk(raw, hash_size, suffix, max_blocks, scope) takes 5 arguments");
        return NULL;
    }
    PyObject *raw_obj = args[0], *suffix_obj = args[2];
    if (!PyBytes_Check(raw_obj) || !PyBytes_Check(suffix_obj)) {
        PyErr_SetString(PyExc_TypeError, "raw and suffix must be bytes");
        return NULL;
    }
    Py_ssize_t hash_size = PyLong_AsSsize_t(args[1]);
    Py_ssize_t max_blocks = PyLong_AsSsize_t(args[3]);
    if ((hash_size == -1 || max_blocks == -1) && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t suffix_size = PyBytes_GET_SIZE(suffix_obj);
    if (hash_size <= 0 || hash_size + suffix_size > MAX_KEY) {
        PyErr_Format(PyExc_ValueError, "hash_size + len(suffix) must be in [1, %d]", MAX_KEY);
        return NULL;
    }
    const char *raw = PyBytes_AS_STRING(raw_obj);
    Py_ssize_t num_hashes = PyBytes_GET_SIZE(raw_obj) / hash_size;
    if (max_blocks > num_hashes) {
        max_blocks = num_hashes;
    }
    if (max_blocks < 0) {
        max_blocks = 0;
    }
    size_t words;
    uint64_t *running = bits_of_int(args[4], &words);
    if (running == NULL) {
        return NULL;
    }
    uint64_t *matching = PyMem_Calloc(words, sizeof(uint64_t));
    PyObject *levels = PyList_New(0);
    Py_hash_t *ahead = PyMem_Malloc(PREFETCH_AHEAD * sizeof(Py_hash_t));
    if (matching == NULL || levels == NULL || ahead == NULL) {
        if (matching == NULL || ahead == NULL) {
            PyErr_NoMemory();
        }
        goto fail;
    }
    uint32_t count = 0;
    for (size_t w = 0; w < words; w++) {
        count += (uint32_t)__builtin_popcountll(running[w]);
    }
    if (count == 0) {
        goto done_empty;
    }
    Py_ssize_t key_size = hash_size + suffix_size;
    const char *suffix = PyBytes_AS_STRING(suffix_obj);
    char keys[PREFETCH_AHEAD][MAX_KEY];
    /* The previous block's set, when every running pool held it. */
    const uint16_t *last_ids = NULL;
    uint32_t last_n = 0;
    Py_ssize_t depth = 0;
    /* A block's key is made and hashed, and its table entry prefetched, PREFETCH_AHEAD blocks
       before it is read; PREFETCH_AHEAD / 2 blocks before, its entry (in cache by then) names
       the key object and the heap set, which are prefetched in turn. So the walk's cache
       misses (entry, key, set: three per block in a table of millions of keys) overlap instead
       of following each other. */
    for (Py_ssize_t b = 0; b < PREFETCH_AHEAD - 1 && b < max_blocks; b++) {
        make_key(self, keys[b], ahead, b, raw, hash_size, suffix, suffix_size);
    }
    for (; depth < max_blocks; depth++) {
        Py_ssize_t next = depth + PREFETCH_AHEAD - 1;
        if (next < max_blocks) {
            make_key(self, keys[next % PREFETCH_AHEAD], ahead, next, raw, hash_size, suffix,
                     suffix_size);
        }
        Py_ssize_t near = depth + PREFETCH_AHEAD / 2;
        if (near < max_blocks) {
            Py_hash_t hash = ahead[near % PREFETCH_AHEAD];
            const Entry *home = &self->table[(size_t)hash & self->mask];
            if (home->key != NULL && home->hash == hash) {
                __builtin_prefetch(home->key);
                if (home->cap) {
                    __builtin_prefetch(home->ids.heap);
                }
            }
        }
        Entry *e = probe(self, ahead[depth % PREFETCH_AHEAD], keys[depth % PREFETCH_AHEAD],
                         key_size);
        if (e->key == NULL) {
            break; /* no pool caches this block: every running pool leaves here */
        }
        const uint16_t *ids = entry_ids(e);
        uint32_t n = e->n;
        if (last_ids != NULL && n == last_n &&
            (ids == last_ids || memcmp(ids, last_ids, n * sizeof(uint16_t)) == 0)) {
            last_ids = ids;
            continue; /* the same holders as the block before: nobody leaves */
        }
        uint32_t kept = 0;
        memset(matching, 0, words * sizeof(uint64_t));
        for (uint32_t k = 0; k < n; k++) {
            size_t w = ids[k] >> 6;
            if (w >= words) {
                break; /* sorted: the rest are above the scope too */
            }
            uint64_t bit = (uint64_t)1 << (ids[k] & 63);
            if (running[w] & bit) {
                matching[w] |= bit;
                kept++;
            }
        }
        if (kept != count) {
            for (size_t w = 0; w < words; w++) {
                running[w] ^= matching[w]; /* the pools leaving at this depth */
            }
            /* Allocating may run the garbage collector, hence other code: forget ids. */
            if (append_level(levels, depth, running, words) < 0) {
                goto fail;
            }
            memcpy(running, matching, words * sizeof(uint64_t));
            count = kept;
            if (count == 0) {
                goto done_empty;
            }
            last_ids = NULL;
            continue;
        }
        /* Every running pool holds this block: a next block with the same set changes nothing
           (a set that only differs outside the running pools is intersected again). */
        last_ids = ids;
        last_n = n;
    }
    if (append_level(levels, depth, running, words) < 0) {
        goto fail;
    }
done_empty:
    PyMem_Free(running);
    PyMem_Free(matching);
    PyMem_Free(ahead);
    return levels;
fail:
    PyMem_Free(running);
    PyMem_Free(matching);
    PyMem_Free(ahead);
    Py_XDECREF(levels);
    return NULL;
}

static PyObject *KeyIndex_sizeof(KeyIndex *self, PyObject *Py_UNUSED(ignored)) {
    size_t size = sizeof(KeyIndex) + (self->mask + 1) * sizeof(Entry);
    for (size_t j = 0; j <= self->mask; j++) {
        if (self->table[j].key != NULL && self->table[j].cap) {
            size += self->table[j].cap * sizeof(uint16_t);
        }
    }
    return PyLong_FromSize_t(size);
}

/* ------------------------------------------------------------------ answering every pool */

static PyObject *str_num_free_blocks;

/* A tuple subclass instance (a NamedTuple) holding the given new references (stolen). */
static PyObject *new_record(PyTypeObject *type, Py_ssize_t n, PyObject **items) {
    for (Py_ssize_t k = 0; k < n; k++) {
        if (items[k] == NULL) {
            for (Py_ssize_t j = 0; j < n; j++) {
                Py_XDECREF(items[j]);
            }
            return NULL;
        }
    }
    PyObject *record = type == &PyTuple_Type ? PyTuple_New(n) : type->tp_alloc(type, n);
    if (record == NULL) {
        for (Py_ssize_t j = 0; j < n; j++) {
            Py_DECREF(items[j]);
        }
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyTuple_SET_ITEM(record, k, items[k]);
    }
    /* Out of the cyclic collector's reach: a record holds only immutable values (numbers,
       names, the shared hit parts, another record), so it can be in no cycle; the collections
       that the 2,000 records of 1,000 pools' answer set off (one per 700 allocations) then
       traverse none of them (tracked, they cost ~0.3-0.9 ms per answer here). */
    if (PyObject_GC_IsTracked(record)) {
        PyObject_GC_UnTrack(record);
    }
    return record;
}

/* One pool of an every-pool answer: its rank key, then what its PoolHit is made of (hit is
   set for the rows of pools the index does not hold: their PoolHit comes made). */
typedef struct {
    double neg_score;
    long long waiting; /* requests tracked - running (the rank key; the load clamps it at 0) */
    double usage;
    PyObject *name; /* borrowed from the columns or the row */
    PyObject *hit;  /* borrowed: a direct row's PoolHit; NULL for an indexed pool */
    PyObject *free_obj; /* owned: the free count read (goes to the PoolLoad) */
    PyObject *medium;   /* borrowed */
    Py_ssize_t order;   /* the name's rank where the names came sorted, else -1 */
    long long num_hit;
    long long num_tokens;
    Py_ssize_t num_running;
    double score;
} Cand;

static int compare_cands(const void *a, const void *b) {
    const Cand *x = a, *y = b;
    if (x->neg_score != y->neg_score) {
        return x->neg_score < y->neg_score ? -1 : 1;
    }
    if (x->waiting != y->waiting) {
        return x->waiting < y->waiting ? -1 : 1;
    }
    if (x->usage != y->usage) {
        return x->usage < y->usage ? -1 : 1;
    }
    if (x->order >= 0) { /* the names came in order (all candidates have one then) */
        return x->order < y->order ? -1 : (x->order > y->order);
    }
    return PyUnicode_Compare(x->name, y->name); /* str against str: cannot fail */
}

/* The hit (blocks) of every slot the levels name, in a new array of *num_slots (slots past it
   hit nothing), or NULL with an exception set. */
static long long *hits_of_levels(PyObject *levels, size_t *num_slots) {
    size_t most = 1;
    for (Py_ssize_t l = 0; l < PyList_GET_SIZE(levels); l++) {
        PyObject *level = PyList_GET_ITEM(levels, l);
        if (!PyTuple_Check(level) || PyTuple_GET_SIZE(level) != 2 ||
            !PyLong_Check(PyTuple_GET_ITEM(level, 1))) {
            PyErr_SetString(PyExc_TypeError, "answer_all: levels are (blocks, mask) pairs");
            return NULL;
        }
        size_t nbits = _PyLong_NumBits(PyTuple_GET_ITEM(level, 1));
        if (nbits == (size_t)-1 && PyErr_Occurred()) {
            return NULL;
        }
        if (nbits > most) {
            most = nbits;
        }
    }
    long long *hits = PyMem_Calloc(most, sizeof(long long));
    if (hits == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t l = 0; l < PyList_GET_SIZE(levels); l++) {
        PyObject *level = PyList_GET_ITEM(levels, l);
        long long num_blocks = PyLong_AsLongLong(PyTuple_GET_ITEM(level, 0));
        if (num_blocks == -1 && PyErr_Occurred()) {
            PyMem_Free(hits);
            return NULL;
        }
        if (num_blocks == 0) {
            continue;
        }
        size_t words;
        uint64_t *bits = bits_of_int(PyTuple_GET_ITEM(level, 1), &words);
        if (bits == NULL) {
            PyMem_Free(hits);
            return NULL;
        }
        for (size_t w = 0; w < words; w++) {
            uint64_t word = bits[w];
            while (word) {
                size_t slot = w * 64 + (size_t)__builtin_ctzll(word);
                word &= word - 1;
                if (slot < most) {
                    hits[slot] = num_blocks;
                }
            }
        }
        PyMem_Free(bits);
    }
    *num_slots = most;
    return hits;
}

#define LOAD_AHEAD 8
#define FREE_AHEAD 8

/* The offset at which instances of type keep num_free_blocks, where it is an object slot
   (a __slots__ member) read by the generic getattr; -1 otherwise (read through getattr). */
static Py_ssize_t free_slot_offset(PyTypeObject *type) {
    if (type->tp_getattro != PyObject_GenericGetAttr) {
        return -1;
    }
    PyObject *descr = _PyType_Lookup(type, str_num_free_blocks); /* borrowed; sets no error */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & PY_AUDIT_READ)) {
        return -1;
    }
    return member->offset;
}

/* Score one kind's pools (its columns) into cands[*count..). The pools' objects are scattered
   over a large heap and mostly out of the CPU's caches, so the reads are pipelined: every
   object of the pool LOAD_AHEAD ahead is prefetched while one pool's are read, and the free
   count's int object (read in a second pass) as soon as it is known. */
static int score_kind(PyObject *spec, double weight, Cand *cands, Py_ssize_t *count) {
    if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4) {
        PyErr_SetString(PyExc_TypeError, "answer_all: a kind is (levels, block_size, num_tokens, "
                                         "columns)");
        return -1;
    }
    PyObject *levels = PyTuple_GET_ITEM(spec, 0), *columns = PyTuple_GET_ITEM(spec, 3);
    long long block_size = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 1));
    long long num_tokens = PyLong_AsLongLong(PyTuple_GET_ITEM(spec, 2));
    if (PyErr_Occurred()) {
        return -1;
    }
    if (!PyList_Check(levels) || !PyTuple_Check(columns) || PyTuple_GET_SIZE(columns) != 7 ||
        num_tokens <= 0) {
        PyErr_SetString(PyExc_TypeError, "answer_all: bad kind");
        return -1;
    }
    PyObject *slots = PyTuple_GET_ITEM(columns, 0), *queues = PyTuple_GET_ITEM(columns, 1);
    PyObject *running = PyTuple_GET_ITEM(columns, 2), *requests = PyTuple_GET_ITEM(columns, 3);
    PyObject *names = PyTuple_GET_ITEM(columns, 4), *usable = PyTuple_GET_ITEM(columns, 5);
    PyObject *media = PyTuple_GET_ITEM(columns, 6);
    PyObject *lists[7] = {slots, queues, running, requests, names, usable, media};
    if (!PyList_Check(slots)) {
        PyErr_SetString(PyExc_TypeError, "answer_all: columns must be lists of one length");
        return -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    for (int c = 0; c < 7; c++) {
        if (!PyList_Check(lists[c]) || PyList_GET_SIZE(lists[c]) != n) {
            PyErr_SetString(PyExc_TypeError, "answer_all: columns must be lists of one length");
            return -1;
        }
    }
    size_t num_slots = 0;
    long long *hits = hits_of_levels(levels, &num_slots);
    if (hits == NULL) {
        return -1;
    }
    Cand *out = cands + *count;
    for (Py_ssize_t i = 0; i < n && i < LOAD_AHEAD; i++) {
        for (int c = 0; c < 6; c++) {
            __builtin_prefetch(PyList_GET_ITEM(lists[c], i));
        }
    }
    /* The free counts are read from the queues' slot directly where the queue's type keeps
       num_free_blocks in one (FreeKVCacheBlockQueue's __slots__), borrowed and prefetched,
       and only referenced FREE_AHEAD pools later, when the int's line has come in (taking
       the reference at once stalled on that miss, the largest part of this loop at 10M
       blocks). Between a borrow and its reference only C code runs on this thread (exact
       dicts' and ints' reads), so no other thread can replace the count meanwhile; before
       anything that might run Python code (another queue type, or a column entry that is not
       an exact dict or int) every borrowed count is referenced first. *count counts the
       candidates holding their reference (the caller releases those on error). */
    PyTypeObject *queue_type = NULL;
    Py_ssize_t queue_offset = -1;
    Py_ssize_t held = *count; /* out[0 .. held - *count) hold their reference */
    Py_ssize_t base = *count;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + LOAD_AHEAD < n) {
            for (int c = 0; c < 6; c++) {
                __builtin_prefetch(PyList_GET_ITEM(lists[c], i + LOAD_AHEAD));
            }
        }
        PyObject *name = PyList_GET_ITEM(names, i);
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "answer_all: names must be str");
            PyMem_Free(hits);
            return -1;
        }
        PyObject *queue = PyList_GET_ITEM(queues, i);
        PyObject *slot_obj = PyList_GET_ITEM(slots, i), *usable_obj = PyList_GET_ITEM(usable, i);
        PyObject *running_obj = PyList_GET_ITEM(running, i);
        PyObject *requests_obj = PyList_GET_ITEM(requests, i);
        if (Py_TYPE(queue) != queue_type) {
            queue_type = Py_TYPE(queue);
            queue_offset = free_slot_offset(queue_type);
        }
        PyObject *free_obj = NULL;
        if (queue_offset >= 0 && PyLong_CheckExact(slot_obj) && PyLong_CheckExact(usable_obj) &&
            PyDict_CheckExact(running_obj) && PyDict_CheckExact(requests_obj)) {
            free_obj = *(PyObject **)((char *)queue + queue_offset); /* borrowed */
        }
        Cand *cand = out + i;
        if (free_obj == NULL) {
            for (; held < base + i; held++) {
                Py_INCREF(cands[held].free_obj);
            }
            *count = held;
            free_obj = PyObject_GetAttr(queue, str_num_free_blocks);
            if (free_obj == NULL) {
                PyMem_Free(hits);
                return -1;
            }
            cand->free_obj = free_obj;
            *count = ++held; /* owns free_obj from here (released by the caller on error) */
        } else {
            cand->free_obj = free_obj;
        }
        __builtin_prefetch(free_obj);
        if (held + FREE_AHEAD <= base + i) {
            Py_INCREF(cands[held].free_obj);
            *count = ++held;
        }
        cand->name = name;
        cand->medium = PyList_GET_ITEM(media, i);
        cand->hit = NULL;
        cand->num_tokens = num_tokens;
        long long slot = PyLong_AsLongLong(slot_obj);
        /* usage is kept here until the second pass (the usable blocks) */
        cand->score = (double)PyLong_AsLongLong(usable_obj);
        cand->num_running = PyObject_Size(running_obj);
        cand->waiting = (long long)PyObject_Size(requests_obj);
        if (PyErr_Occurred()) {
            PyMem_Free(hits);
            return -1;
        }
        if (slot < 0 || slot > MAX_SLOT) {
            PyErr_SetString(PyExc_ValueError, "answer_all: slot out of range");
            PyMem_Free(hits);
            return -1;
        }
        cand->num_hit = (size_t)slot < num_slots ? hits[slot] * block_size : 0;
        cand->waiting -= (long long)cand->num_running;
    }
    for (; held < base + n; held++) {
        Py_INCREF(cands[held].free_obj);
    }
    *count = held;
    PyMem_Free(hits);
    for (Py_ssize_t i = 0; i < n; i++) {
        Cand *cand = out + i;
        long long num_free = PyLong_AsLongLong(cand->free_obj);
        if (num_free == -1 && PyErr_Occurred()) {
            return -1;
        }
        double num_usable = cand->score;
        /* The same double operations, in the same order, as the Python twin (the build turns
           off contracting them into fused multiply-adds): identical scores. */
        double usage = num_usable != 0.0 ? 1.0 - (double)num_free / num_usable : 0.0;
        double score = (double)cand->num_hit / (double)num_tokens - weight * usage;
        cand->neg_score = -score;
        cand->usage = usage;
        cand->score = score;
    }
    return 0;
}

/* What the last PoolHit made was made of, reused by the next where equal (the ranking puts
   equal hits, scores and usages side by side): fewer new objects per pool. Each holds a
   reference (NULL: none yet); released by recent_clear. */
typedef struct {
    long long hit;
    PyObject *medium; /* borrowed, compared by identity (the media are interned names) */
    PyObject *hit_obj, *groups, *tiers;
    long long num_tokens;
    PyObject *num_tokens_obj;
    double usage, score; /* compared bit for bit (0.0 and -0.0 stay apart) */
    PyObject *usage_obj, *score_obj;
} Recent;

static void recent_clear(Recent *recent) {
    Py_CLEAR(recent->hit_obj);
    Py_CLEAR(recent->groups);
    Py_CLEAR(recent->tiers);
    Py_CLEAR(recent->num_tokens_obj);
    Py_CLEAR(recent->usage_obj);
    Py_CLEAR(recent->score_obj);
}

/* A new reference to a float of value, the last one made if it has the same bits. */
static PyObject *recent_float(double value, double *last, PyObject **last_obj) {
    if (*last_obj != NULL && memcmp(&value, last, sizeof value) == 0) {
        Py_INCREF(*last_obj);
        return *last_obj;
    }
    PyObject *made = PyFloat_FromDouble(value);
    if (made != NULL) {
        Py_XSETREF(*last_obj, Py_NewRef(made));
        *last = value;
    }
    return made;
}

/* The hit's int and its group and tier parts (shared through parts), as new references. */
static int hit_parts_of(Cand *cand, PyObject *parts, PyObject *hit_parts, Recent *recent,
                        PyObject **hit_out, PyObject **groups_out, PyObject **tiers_out) {
    if (recent->hit_obj != NULL && recent->hit == cand->num_hit &&
        recent->medium == cand->medium) {
        *hit_out = Py_NewRef(recent->hit_obj);
        *groups_out = Py_NewRef(recent->groups);
        *tiers_out = Py_NewRef(recent->tiers);
        return 0;
    }
    PyObject *hit_obj = PyLong_FromLongLong(cand->num_hit);
    if (hit_obj == NULL) {
        return -1;
    }
    PyObject *shared = PyDict_GetItemWithError(parts, hit_obj); /* borrowed */
    int has_medium = 0;
    if (shared != NULL && PyTuple_Check(shared) && PyTuple_GET_SIZE(shared) == 2) {
        has_medium = PySequence_Contains(PyTuple_GET_ITEM(shared, 1), cand->medium);
    }
    if (has_medium < 0 || PyErr_Occurred()) {
        Py_DECREF(hit_obj);
        return -1;
    }
    PyObject *made = NULL;
    if (!has_medium) {
        made = PyObject_CallFunctionObjArgs(hit_parts, parts, hit_obj, cand->medium, NULL);
        if (made == NULL || !PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 2) {
            if (made != NULL) {
                PyErr_SetString(PyExc_TypeError, "answer_all: hit_parts answers a pair");
            }
            Py_XDECREF(made);
            Py_DECREF(hit_obj);
            return -1;
        }
        shared = made;
    }
    PyObject *groups = Py_NewRef(PyTuple_GET_ITEM(shared, 0));
    PyObject *tiers = Py_NewRef(PyTuple_GET_ITEM(shared, 1));
    Py_XDECREF(made);
    Py_XSETREF(recent->hit_obj, Py_NewRef(hit_obj));
    Py_XSETREF(recent->groups, Py_NewRef(groups));
    Py_XSETREF(recent->tiers, Py_NewRef(tiers));
    recent->hit = cand->num_hit;
    recent->medium = cand->medium;
    *hit_out = hit_obj;
    *groups_out = groups;
    *tiers_out = tiers;
    return 0;
}

/* The PoolHit of an indexed pool's candidate. */
static PyObject *make_hit(Cand *cand, PyObject *parts, PyObject *hit_parts, PyTypeObject *pool_hit,
                          PyTypeObject *pool_load, Recent *recent) {
    PyObject *hit_obj, *groups, *tiers;
    if (hit_parts_of(cand, parts, hit_parts, recent, &hit_obj, &groups, &tiers) < 0) {
        return NULL;
    }
    PyObject *num_tokens_obj;
    if (recent->num_tokens_obj != NULL && recent->num_tokens == cand->num_tokens) {
        num_tokens_obj = Py_NewRef(recent->num_tokens_obj);
    } else {
        num_tokens_obj = PyLong_FromLongLong(cand->num_tokens);
        if (num_tokens_obj != NULL) {
            Py_XSETREF(recent->num_tokens_obj, Py_NewRef(num_tokens_obj));
            recent->num_tokens = cand->num_tokens;
        }
    }
    PyObject *free_obj = cand->free_obj;
    cand->free_obj = NULL; /* the reference goes to the PoolLoad */
    PyObject *load_items[4] = {
        recent_float(cand->usage, &recent->usage, &recent->usage_obj),
        free_obj,
        PyLong_FromSsize_t(cand->num_running),
        PyLong_FromLongLong(cand->waiting > 0 ? cand->waiting : 0),
    };
    PyObject *load = new_record(pool_load, 4, load_items);
    Py_INCREF(cand->name);
    PyObject *hit_items[7] = {cand->name,
                              hit_obj,
                              groups,
                              tiers,
                              num_tokens_obj,
                              load,
                              recent_float(cand->score, &recent->score, &recent->score_obj)};
    return new_record(pool_hit, 7, hit_items);
}

/* answer_all(kinds, rows, weight, parts, hit_parts, pool_hit, pool_load): every pool answered,
 * best first (kvcm.core.lookup._answer_all): each kind (levels, block_size, num_tokens,
 * columns) scored from its columns, with the rows of the pools the index does not hold
 * ((-score, waiting, usage, name, PoolHit)), sorted by (-score, waiting, usage, name) in one
 * qsort of C records; the indexed pools' PoolHits made last, in rank order, out of the
 * cyclic collector's reach (see new_record), and the answer tuple tracked once full. */
static PyObject *answer_all(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "answer_all takes 7 arguments");
        return NULL;
    }
    PyObject *kinds = args[0], *rows = args[1], *parts = args[3], *hit_parts = args[4];
    double weight = PyFloat_AsDouble(args[2]);
    if (weight == -1.0 && PyErr_Occurred()) {
        return NULL;
    }
    if (!PyList_Check(kinds) || !PyList_Check(rows) || !PyDict_Check(parts) ||
        !PyType_Check(args[5]) || !PyType_Check(args[6]) ||
        !PyType_IsSubtype((PyTypeObject *)args[5], &PyTuple_Type) ||
        !PyType_IsSubtype((PyTypeObject *)args[6], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "answer_all: bad arguments");
        return NULL;
    }
    PyTypeObject *pool_hit = (PyTypeObject *)args[5], *pool_load = (PyTypeObject *)args[6];
    Py_ssize_t total = PyList_GET_SIZE(rows);
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(kinds); k++) {
        PyObject *spec = PyList_GET_ITEM(kinds, k);
        if (!PyTuple_Check(spec) || PyTuple_GET_SIZE(spec) != 4 ||
            !PyTuple_Check(PyTuple_GET_ITEM(spec, 3)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(spec, 3)) != 7 ||
            !PyList_Check(PyTuple_GET_ITEM(PyTuple_GET_ITEM(spec, 3), 0))) {
            PyErr_SetString(PyExc_TypeError, "answer_all: bad kind");
            return NULL;
        }
        total += PyList_GET_SIZE(PyTuple_GET_ITEM(PyTuple_GET_ITEM(spec, 3), 0));
    }
    Cand *cands = PyMem_Malloc((total ? (size_t)total : 1) * sizeof(Cand));
    if (cands == NULL) {
        return PyErr_NoMemory();
    }
    Py_ssize_t count = 0;
    PyObject *answer = NULL;
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!PyTuple_Check(row) || PyTuple_GET_SIZE(row) < 5 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(row, 3))) {
            PyErr_SetString(PyExc_TypeError,
                            "answer_all: rows are (-score, waiting, usage, name, hit)");
            goto done;
        }
        Cand *cand = cands + count;
        cand->neg_score = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 0));
        cand->waiting = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 1));
        cand->usage = PyFloat_AsDouble(PyTuple_GET_ITEM(row, 2));
        cand->name = PyTuple_GET_ITEM(row, 3);
        cand->hit = PyTuple_GET_ITEM(row, 4);
        cand->free_obj = NULL;
        count++;
        if (PyErr_Occurred()) {
            goto done;
        }
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(kinds); k++) {
        if (score_kind(PyList_GET_ITEM(kinds, k), weight, cands, &count) < 0) {
            goto done;
        }
    }
    /* Most pools tie on the first three keys (the same hit, no load), so most comparisons
       reach the names: where the names came sorted (a whole kind's columns are, and one kind
       is the usual scope), each candidate's rank among them stands for its name. */
    Py_ssize_t sorted = 1;
    for (Py_ssize_t i = 1; i < count && sorted; i++) {
        sorted = PyUnicode_Compare(cands[i - 1].name, cands[i].name) < 0;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        cands[i].order = sorted ? i : -1;
    }
    qsort(cands, (size_t)count, sizeof(Cand), compare_cands);
    answer = PyTuple_New(count);
    if (answer == NULL) {
        goto done;
    }
    /* Untracked while it holds NULLs and its records are made (collections that the records'
       allocations set off skip it), and after, unless it holds a tracked PoolHit (a direct
       row's): it can then be in no cycle either. */
    PyObject_GC_UnTrack(answer);
    int track = 0;
    Recent recent = {0};
    for (Py_ssize_t i = 0; i < count; i++) {
        Cand *cand = cands + i;
        PyObject *hit = cand->hit;
        if (hit != NULL) {
            Py_INCREF(hit);
            track |= PyObject_GC_IsTracked(hit);
        } else {
            hit = make_hit(cand, parts, hit_parts, pool_hit, pool_load, &recent);
            if (hit == NULL) {
                recent_clear(&recent);
                Py_CLEAR(answer); /* its NULL items are skipped */
                goto done;
            }
        }
        PyTuple_SET_ITEM(answer, i, hit);
    }
    recent_clear(&recent);
    if (track) {
        PyObject_GC_Track(answer);
    }
done:
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(cands[i].free_obj);
    }
    PyMem_Free(cands);
    return answer;
}

static PyMethodDef module_methods[] = {
    {"answer_all", (PyCFunction)(void (*)(void))answer_all, METH_FASTCALL,
     "answer_all(kinds, rows, weight, parts, hit_parts, pool_hit, pool_load): every pool "
     "answered, best first (kvcm.core.lookup._answer_all)."},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef KeyIndex_methods[] = {
    {"add", (PyCFunction)(void (*)(void))KeyIndex_add, METH_FASTCALL,
     "add(keys, slot): put slot in the set of every key of keys (bytes)."},
    {"discard", (PyCFunction)(void (*)(void))KeyIndex_discard, METH_FASTCALL,
     "discard(keys, slot): take slot out of the set of every key of keys; a key left with "
     "no slot is forgotten."},
    {"get", (PyCFunction)KeyIndex_get, METH_O,
     "get(key): the mask (int, bit i = slot i) of the slots holding key; 0 if none."},
    {"walk", (PyCFunction)(void (*)(void))KeyIndex_walk, METH_FASTCALL,
     "walk(raw, hash_size, suffix, max_blocks, scope): [(blocks hit, mask of the scope's "
     "slots hitting exactly that many)], deepest last; see kvcm.core._key_index."},
    {"__sizeof__", (PyCFunction)KeyIndex_sizeof, METH_NOARGS, "Bytes held."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods KeyIndex_as_sequence = {
    .sq_length = (lenfunc)KeyIndex_len,
};

static PyTypeObject KeyIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvcm.core._lookup_index.KeyIndex",
    .tp_doc = PyDoc_STR("Cache key -> set of pool slots, walked per prompt (compiled)."),
    .tp_basicsize = sizeof(KeyIndex),
    .tp_itemsize = 0,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = KeyIndex_new,
    .tp_dealloc = (destructor)KeyIndex_dealloc,
    .tp_methods = KeyIndex_methods,
    .tp_as_sequence = &KeyIndex_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvcm.core._lookup_index",
    .m_doc = "The lookup's cross-pool key index, compiled (kvcm.core._key_index is the same "
             "in Python).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__lookup_index(void) {
    if (PyType_Ready(&KeyIndexType) < 0) {
        return NULL;
    }
    str_num_free_blocks = PyUnicode_InternFromString("num_free_blocks");
    if (str_num_free_blocks == NULL) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&KeyIndexType);
    if (PyModule_AddObject(m, "KeyIndex", (PyObject *)&KeyIndexType) < 0) {
        Py_DECREF(&KeyIndexType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_SLOT", MAX_SLOT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
